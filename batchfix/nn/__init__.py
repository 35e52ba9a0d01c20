"""The network in pure torch: guarded attention and genomic-coordinate encodings (attention), the
locus-token encoder, latent and batch-conditioned decoder (network). No Lightning, no files."""
