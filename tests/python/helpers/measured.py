"""Collects the measured errors so the run ends with one table of maxima."""
ERRORS = {}


def record(precision, quantity, value):
    key = (precision, quantity)
    ERRORS[key] = max(ERRORS.get(key, 0.0), value)


def summary_lines():
    return ["%-5s %-22s %.3e" % (p, q, v) for (p, q), v in sorted(ERRORS.items())]
