"""Baseline corrections shared by scripts/benchmark.py and scripts/cnv_benchmark.py."""
from __future__ import annotations

import importlib.util

import anndata as ad
import numpy as np

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
