"""Recommendation with NCF (NeuMF) on MovieLens (the seeds' NCF benchmark); MovieLens-100K installs offline."""
