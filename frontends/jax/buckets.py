"""Capacity policies of `sparsecore.jax` plans: the core's `sparsecore.buckets` (one design, shared with the
core's capacity mode, `sparsecore.capacity`)."""

from sparsecore.buckets import Buckets, CapacityError, CapacityPolicy, Fixed, as_policy

__all__ = ["CapacityError", "CapacityPolicy", "Buckets", "Fixed", "as_policy"]
