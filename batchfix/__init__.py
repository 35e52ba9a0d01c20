"""batchfix: batch-effect correction for gene-expression matrices, with self-attention over genes
in genomic order.

    import batchfix
    batchfix.correct(adata, "run/model.ckpt")   # adds layers['batchfix'], obsm['X_batchfix']
"""
from __future__ import annotations

__version__ = "0.1.0"


def correct(adata, checkpoint, reference=None, counts_layer=None, key_added="batchfix", chunk_size=4096,
            max_missing_fraction=0.2, copy=False):
    """Correct an in-memory AnnData with a trained checkpoint (see batchfix.correction.correct_adata)."""
    from batchfix.correction import correct_adata

    return correct_adata(adata, checkpoint, reference=reference, counts_layer=counts_layer, key_added=key_added,
                         chunk_size=chunk_size, max_missing_fraction=max_missing_fraction, copy=copy)
