"""The data every role agrees on: the trajectory (and the staleness rule), the accounting identity, evaluation metrics."""
