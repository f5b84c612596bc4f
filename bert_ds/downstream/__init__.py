"""Downstream use of a pre-trained BERT: fine-tuning on labelled tasks and feature extraction."""
