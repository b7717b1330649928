"""Validation: outcome data, routing metrics (APGR), family / mixed / LOFO tables, evaluate, calibrate.
May import classifier.inference, classifier.text and classifier.data; never classifier.training."""
