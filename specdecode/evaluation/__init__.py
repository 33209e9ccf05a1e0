"""Evaluation: the decode benchmark, the evaluation suite and its reports."""
