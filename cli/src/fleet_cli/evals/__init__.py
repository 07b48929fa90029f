"""`fleet eval`: run a JSONL dataset as real Turns through a gateway's queue, score the answers,
write a receipt, and compare two receipts (docs/rlm.md, "Evaluating answers")."""
