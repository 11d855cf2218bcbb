"""One error type for every bad feature value, carrying the field's name so that an HTTP layer can answer
422 naming it and a CLI can print it without a traceback."""

# Longest problem text kept: a message quotes the bad value, and a hostile one (a string of megabytes) must not
# come back whole in the answer or fill the log.
MAX_PROBLEM_CHARS = 300


class FeatureError(ValueError):
    """A feature value is missing, of the wrong type, or out of range."""

    def __init__(self, field: str, problem: str) -> None:
        if len(problem) > MAX_PROBLEM_CHARS:
            problem = f"{problem[: MAX_PROBLEM_CHARS - 20]}... ({len(problem):,} characters)"
        self.field = field[:MAX_PROBLEM_CHARS]
        self.problem = problem
        super().__init__(f"{field}: {problem}")
