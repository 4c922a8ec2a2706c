"""Corpus curation (`lmforge data`): normalise, filter, redact, deduplicate, with a readable report."""
