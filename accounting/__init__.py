"""Privacy accounting: event records, accountants (PLD, RDP, GDP), calibration and the ledger."""
