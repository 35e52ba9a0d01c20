"""Data in: reading and validating AnnData, gene coordinates and selection, normalisation, model-ready cells.

io (read, validate, atomic writes) -> genome (coordinates, genomic order, locus windows) -> select (HVGs)
-> prepare (tensors, minibatches, the Lightning data module); ondisk and streaming do the same from a
file read in row chunks. Nothing here imports torch models, training or evaluation.
"""
