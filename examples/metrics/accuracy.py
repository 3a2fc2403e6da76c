"""Accuracy as a local ``evaluate`` metric, so it loads offline.

``evaluate.load("accuracy")`` fetches its script from the Hugging Face Hub; this
file gives the same metric without a network::

    import evaluate
    accuracy = evaluate.load("examples/metrics/accuracy.py")
    accuracy.compute(predictions=[0, 1, 1], references=[0, 1, 0])  # {'accuracy': 0.666...}
"""

from __future__ import annotations

import datasets
import evaluate

_DESCRIPTION = "Accuracy: the fraction of predictions equal to their reference label."

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
Returns:
    accuracy (`float`): fraction of correct predictions, in [0, 1].
"""


class Accuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions: list[int], references: list[int]) -> dict[str, float]:
        if not references:
            raise ValueError("accuracy needs at least one prediction")
        correct = sum(int(p == r) for p, r in zip(predictions, references))
        return {"accuracy": correct / len(references)}
