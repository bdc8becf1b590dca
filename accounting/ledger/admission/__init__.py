"""The ledger's budget arithmetic, pure: plans, exact RDP tallies, the admission filter, budgets and block rules."""

from accounting.ledger.admission.blocks import (
    BLOCK_FILES,
    BLOCK_SELECTORS,
    MAX_BLOCK_FILES,
    MAX_HASH_BUCKETS,
    USER_SELECTORS,
    block_data_overlap,
    check_block_data,
)
from accounting.ledger.admission.budgets import (
    ADMISSION_MARGIN,
    BudgetCheck,
    BudgetFigures,
    FitReport,
    assess_admission,
    budget_figures,
    check_admission,
    check_new_budget,
    fits_budget,
    rdp_figures,
)
from accounting.ledger.admission.plans import (
    canonical,
    charged_plan,
    check_plan,
    committed_json_with,
    mechanisms_of,
    parse_plan,
    split_steps,
    uncached_mechanisms,
)
from accounting.ledger.admission.rule import (
    AdmissionRule,
    FILTER_ORDER_COUNT,
    FILTER_RULE,
    order_epsilon,
)
from accounting.ledger.admission.tally import (
    RdpTally,
    remember_stored_tally,
    stored_tally,
)

__all__ = [
    "ADMISSION_MARGIN",
    "AdmissionRule",
    "BLOCK_FILES",
    "BLOCK_SELECTORS",
    "BudgetCheck",
    "BudgetFigures",
    "FILTER_ORDER_COUNT",
    "FILTER_RULE",
    "FitReport",
    "MAX_BLOCK_FILES",
    "MAX_HASH_BUCKETS",
    "RdpTally",
    "USER_SELECTORS",
    "assess_admission",
    "block_data_overlap",
    "budget_figures",
    "canonical",
    "charged_plan",
    "check_admission",
    "check_block_data",
    "check_new_budget",
    "check_plan",
    "committed_json_with",
    "fits_budget",
    "mechanisms_of",
    "order_epsilon",
    "parse_plan",
    "rdp_figures",
    "remember_stored_tally",
    "split_steps",
    "stored_tally",
    "uncached_mechanisms",
]
