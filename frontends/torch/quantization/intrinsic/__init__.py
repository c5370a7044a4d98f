"""Fused float sparse modules (spconv's ``spconv.pytorch.quantization.intrinsic``)."""

from .modules import SpconvAddReLUNd, SpconvBnAddReLUNd, SpconvBnNd, SpconvBnReLUNd, SpconvReLUNd

__all__ = ["SpconvReLUNd", "SpconvBnNd", "SpconvBnReLUNd", "SpconvBnAddReLUNd", "SpconvAddReLUNd"]
