"""Quantization schemes: float tensors to int8/int4 and back."""
