"""The accounting room: DP event records, accountants (PLD, RDP, GDP), calibration, auditing; the ledger in ledger/."""

from accounting.lazy import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "accountants": ["ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "PLD_FALLBACK_LABEL", "RDP_ORDERS", "SKELLAM_LABEL",
                    "get_accountant", "label", "labelled_epsilon", "one_step_pld", "sampled_gaussian_rdp"],
    "auditing": ["audit_scores", "dirac_canary_scores", "pattern_canary_scores"],
    "calibration": ["UnreachableTargetError", "noise_multiplier_for", "scale_for_epsilon", "scale_for_target"],
    "events": ["Composition", "CorrelatedGaussian", "NOISE_PLACEMENTS", "SampledGaussian", "SampledSkellam",
               "event_of", "group_events", "noise_placement", "skellam_events", "steps_for_epochs"],
    "lazy": ["LazyModule", "public_face"],
    "matrix_mechanisms": ["CORRELATED_MECHANISMS", "MECHANISMS", "SAMPLERS", "CorrelatedNoisePlan", "StrategyError",
                          "band_coefficients", "banded_prefix_rmse", "banded_sensitivity", "decorrelated_observations",
                          "sampler_refusal",
                          "tree_levels", "tree_nodes", "tree_prefix_rmse", "tree_sensitivity"],
    "skellam": ["SILO_NOISE_ROUNDING_RATIO", "poisson_subsampled_rdp", "sampled_skellam_rdp", "skellam_rdp"],
})
