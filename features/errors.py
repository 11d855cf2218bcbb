"""One error type for every bad feature value, carrying the field's name so that an HTTP layer can answer
422 naming it and a CLI can print it without a traceback."""


class FeatureError(ValueError):
    """A feature value is missing, of the wrong type, or out of range."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")
