"""dpfleet's Python API, imported as `dpfleet`: train through the ledger, the accountants, the ledger, exported models."""

from accounting.lazy import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "api": ["Ledger", "Result", "epsilon", "load", "noise_multiplier", "train"],
})
