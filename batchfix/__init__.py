"""batchfix: batch-effect correction for gene-expression matrices, with self-attention over genes
in genomic order.

    import batchfix
    batchfix.correct(adata, "run/model.ckpt")   # adds layers['batchfix'], obsm['X_batchfix']
"""
from __future__ import annotations

__version__ = "0.1.0"


def correct(adata, checkpoint, *, reference=None, counts_layer=None, key_added="batchfix", copy=False,
            max_missing_fraction=0.2, chunk_size=4096, batch_size=128, progress=False):
    """Batch-correct an in-memory AnnData with a trained checkpoint, scanpy style.

    Parameters
    ----------
    adata
        Cells x genes; var_names are matched to the model's genes by name. Raw counts in X, or in
        `counts_layer` (log-normalized values for a model trained with data.scale=log).
    checkpoint
        A trained model: `<run folder>/model.ckpt` (loaded without executing code from the file).
    reference
        A training batch to express every cell as, or None / "average" for the average over the
        training batches. Cells of batches the model never saw are corrected too.
    key_added
        Names what is added: layers[key_added], var[f"{key_added}_modelled"], obsm[f"X_{key_added}"],
        uns[key_added].
    copy
        Return a corrected copy instead of adding to `adata` (which is then left unchanged).
    max_missing_fraction
        Refuse (InputError) when more than this share of the model's genes is missing from var_names;
        fewer missing genes enter the model as zeros and are listed in uns[key_added]["missing_genes"].
    chunk_size, batch_size
        Cells processed at a time, and cells per forward pass of the network.

    Adds layers[key_added] (float32 CSR, corrected log1p expression per 10k counts, values stored for
    the modelled genes only: other genes read as 0 and are False in var[f"{key_added}_modelled"]),
    obsm[f"X_{key_added}"] (the latent) and uns[key_added] (version, checkpoint sha256, reference
    batch, modelled and missing genes, parameters). Returns the copy when copy=True, else None.
    For .h5ad files of any size use `batchfix.correction.correct_file` (or `python -m batchfix
    correct`), which streams cells from disk.
    """
    from batchfix.correction import correct_adata

    return correct_adata(adata, checkpoint, reference=reference, counts_layer=counts_layer, key_added=key_added,
                         chunk_size=chunk_size, max_missing_fraction=max_missing_fraction, copy=copy,
                         batch_size=batch_size, progress=progress)
