"""Measurements of the seed documents' theory inside real models: attention spectra and bounds,
rank collapse, gradient flow, activation statistics, FFN sparsity and head redundancy."""
