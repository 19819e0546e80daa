"""Deployment: gcloud commands and scripts rendered from the config (`xla-shard gcp render`)."""
