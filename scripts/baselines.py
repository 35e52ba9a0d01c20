"""Baseline corrections shared by scripts/benchmark.py and scripts/cnv_benchmark.py."""
from __future__ import annotations

import importlib.util

import anndata as ad
import numpy as np
import scipy.sparse as sp

BENCH_EXTRA = 'pip install -e ".[bench]"'


def missing_module(module: str) -> str | None:
    """A message naming the bench extra when `module` is not installed, else None."""
    if importlib.util.find_spec(module) is not None:
        return None
    return f"{module} is not installed; it comes with the bench extra: {BENCH_EXTRA}"


def combat(log_values: np.ndarray, obs, batch_key: str) -> np.ndarray:
    """scanpy's ComBat on log-scale values (cells, genes), batches from obs[batch_key] (float64, as it returns)."""
    import scanpy as sc

    holder = ad.AnnData(log_values.copy(), obs=obs[[batch_key]].copy())
    sc.pp.combat(holder, key=batch_key)
    return np.asarray(holder.X)


def combat_seq(counts, batches, group=None) -> sp.csr_matrix:
    """ComBat-seq's adjusted counts (cells x genes) of `counts` (inmoose's pycombat_seq); a biological group is passed
    as its one categorical covariate (inmoose's `covar_mod`, the `group=` of R's ComBat_seq)."""
    from inmoose.pycombat import pycombat_seq

    dense = (counts.toarray() if sp.issparse(counts) else np.asarray(counts)).astype(np.float64).T  # genes x cells
    adjusted = pycombat_seq(dense, list(batches), covar_mod=None if group is None else list(group))
    return sp.csr_matrix(np.asarray(adjusted, dtype=np.float32).T)


def cellanova(log_values: np.ndarray, obs, batch_key: str, seed: int = 0) -> np.ndarray:
    """CellANOVA's integrated ('denoised') values, put back on the log scale. Every batch is a control (no batch
    is known to hold only technical variation); its inputs are the standardised log values, as its
    preprocess_data makes them (which normalises to 1e5 per cell; here log1p(counts per 10k), the values every
    other method gets), on the same genes as every other method. `seed` is the random state of the
    Harmony run inside its calc_ME (its PCA's random state is fixed by CellANOVA)."""
    import harmonypy
    from cellanova import model as cellanova_model

    def harmony_integrate(adata, key, max_iter_harmony=10, **kwargs):
        """scanpy's harmony_integrate transposes harmonypy's output, which harmonypy >= 2 already gives as
        (cells, components): CellANOVA's call of it fails there, so it gets this one."""
        result = harmonypy.run_harmony(adata.obsm["X_pca"], adata.obs, key, max_iter_harmony=max_iter_harmony,
                                       verbose=False, random_state=seed, **kwargs)
        adata.obsm["X_pca_harmony"] = np.asarray(result.Z_corr, dtype=np.float32)

    external = cellanova_model.sce.pp  # scanpy.external.pp: replaced for this call only
    original = external.harmony_integrate
    external.harmony_integrate = harmony_integrate
    try:
        mean, sd = log_values.mean(axis=0), log_values.std(axis=0)
        sd[sd == 0] = 1.0
        holder = ad.AnnData((log_values - mean) / sd, obs=obs[[batch_key]].astype(str).copy())
        holder.layers["scale"] = holder.X.copy()
        holder.var["highly_variable"] = True  # calc_ME reads it; every gene given is one
        holder = cellanova_model.calc_ME(holder, integrate_key=batch_key)
        holder = cellanova_model.calc_BE(holder, integrate_key=batch_key,
                                         control_dict={"all": sorted(holder.obs[batch_key].unique())})
        holder = cellanova_model.calc_TE(holder, integrate_key=batch_key)
    finally:
        external.harmony_integrate = original
    return np.asarray(holder.layers["denoised"] * sd + mean, dtype=np.float32)


def scvi_fit(counts: ad.AnnData, batch_key: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """scVI (scvi-tools defaults) trained on raw counts: (latent (cells, k), decoded expression averaged over every
    batch as log1p(counts per 10k) (cells, genes))."""
    import scvi

    from batchfix.data.normalize import LIBRARY_SIZE

    scvi.settings.seed = seed
    adata = counts.copy()
    scvi.model.SCVI.setup_anndata(adata, batch_key=batch_key)
    model = scvi.model.SCVI(adata)
    model.train(enable_progress_bar=False)
    decoded = model.get_normalized_expression(
        transform_batch=list(adata.obs[batch_key].astype("category").cat.categories), library_size=LIBRARY_SIZE,
        return_numpy=True)
    return np.asarray(model.get_latent_representation(), dtype=np.float32), np.log1p(decoded)


def sysvi_missing() -> str | None:
    """A message when scvi-tools has no SysVI (it came in scvi-tools 1.3; the bench extra's scvi-tools may be
    older), else None."""
    if missing := missing_module("scvi"):
        return missing
    import scvi.external

    if hasattr(scvi.external, "SysVI"):
        return None
    return f"scvi-tools {scvi.__version__} has no SysVI (scvi.external.SysVI): it needs scvi-tools >= 1.3"


def sysvi_model(log_values: np.ndarray, obs, batch_key: str, seed: int = 0):
    """SysVI (scvi-tools defaults: VampPrior, cycle-consistency weight 2) trained on log-scale values (cells,
    genes), as it expects, with obs[batch_key] as its system."""
    import scvi
    from scvi.external import SysVI

    scvi.settings.seed = seed
    adata = ad.AnnData(log_values.astype(np.float32), obs=obs[[batch_key]].astype(str).copy())
    SysVI.setup_anndata(adata, batch_key=batch_key)
    model = SysVI(adata)
    model.train(enable_progress_bar=False)
    return model


def sysvi_decoded(model, latent: np.ndarray, batch_codes: list[int]) -> np.ndarray:
    """The decoder's mean (cells, genes) at each latent (cells, k), averaged over the batches of `batch_codes`.

    Done here, not by get_normalized_expression: SysVI's takes transform_batch, but its generative step ignores
    it, so each cell would be decoded in its own batch only."""
    import torch

    module = model.module.eval()
    decoded = np.zeros((len(latent), model.adata.n_vars))
    with torch.no_grad():
        z = torch.from_numpy(np.asarray(latent, dtype=np.float32))
        for code in batch_codes:
            codes = torch.full((len(latent), 1), code, dtype=torch.long)
            decoded += module.generative(z=z, batch_index=codes, cat_covs=[], compute_cycle=False)["px"].mean.numpy()
    return (decoded / len(batch_codes)).astype(np.float32)


def sysvi_fit(log_values: np.ndarray, obs, batch_key: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """SysVI's (latent means (cells, k), decoder mean over every batch (cells, genes), on the log scale its
    decoder models)."""
    model = sysvi_model(log_values, obs, batch_key, seed)
    latent = np.asarray(model.get_latent_representation(), dtype=np.float32)
    return latent, sysvi_decoded(model, latent, list(range(obs[batch_key].nunique())))
