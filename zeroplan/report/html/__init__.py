"""`--format html`: each command's JSON document as one self-contained page (page.py holds the shared pieces;
one module per command: estimate, compare, plan, measure, validate)."""
