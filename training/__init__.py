"""The offline retraining job (sample logs in, models and an accuracy report out). Not built yet: its issue is
still to come; until then the online predictor retrains its own trees in the background (predictor/learner.py).
"""
