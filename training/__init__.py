"""The offline retraining job (`leadtime retrain`): sample logs in, a better model and an accuracy report out.

The online predictor keeps its model current from every observation and retrains its residual trees on a
window of the last 20,000; this job fits those trees on the whole history a fleet has logged, judges them
honestly against the model the registry serves, and publishes them only if they are better. One module each:

- `sources`: JSONL and Parquet files, the service's Redis observation stream; malformed rows counted by line;
- `split`: time order, the most recent slice held out, time-ordered folds for the search;
- `fit`: the residual trees' search, early stopping and calibration (`distributed`: the same on Dask);
- `champion`: both models on the held-out slice, per target, accelerator class and role; the decision;
- `registry`: the directory or Redis registry the service loads from; `report`: JSON, Markdown, plots;
- `job`: the steps in order, and what "the model" is (the online state, with new trees).
"""
