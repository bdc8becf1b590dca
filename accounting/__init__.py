"""The accounting room: DP event records, accountants (PLD, RDP, GDP), calibration, auditing; the ledger in ledger/."""

from accounting.lazy import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "accountants": ["ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "PLD_FALLBACK_LABEL", "get_accountant", "label",
                    "labelled_epsilon"],
    "auditing": ["audit_scores", "dirac_canary_scores"],
    "calibration": ["UnreachableTargetError", "noise_multiplier_for", "scale_for_epsilon", "scale_for_target"],
    "events": ["Composition", "SampledGaussian", "group_events", "steps_for_epochs"],
    "lazy": ["LazyModule", "public_face"],
})
