"""`just bench [lane]`: benchmark lanes that measure against a baseline in the same run and write
JSON receipts to bench/receipts/ (figures on a noisy machine mean something only as ratios)."""
