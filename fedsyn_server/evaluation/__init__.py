"""Evaluate a synthetic text set against held-out real data (the paper's Acc./F1 and more).

Three families of metrics, each a pure function on arrays or lists:

- **Downstream utility** (``downstream_utility``, ``transformer_utility``): train a
  classifier on the synthetic set, test it on real data; accuracy and macro-F1 per
  control-code column (the paper's Acc./F1). The reverse check, ``label_agreement``
  (train on real, predict the synthetic records), gives ``label_fidelity``: how often a
  synthetic text is about what its control code asks for.
- **Distribution alignment** between the two sets' sentence embeddings:
  ``frechet_distance``, ``knn_precision_recall`` (Kynkäänniemi et al. 2019) and
  ``mauve_score`` (Pillutla et al. 2021; needs the optional extra ``fedsyn[eval]``).
- **Allocation error** (``allocation_error``): each code's share in the synthetic set
  against its share in the real data.

``evaluate_sets`` embeds both sets once and computes all of them; ``evaluate_files`` does
the same from two CSV / JSONL / Parquet files (``fedsyn evaluate`` on the command line);
``format_report`` renders the result as a plain-text table; ``write_evaluation`` stores it.

One module per family: ``utility``, ``alignment`` (embeddings and allocation), ``sets`` (the
whole evaluation of one set, from memory or files) and ``report``; this package re-exports
their public functions.

Heavy libraries (sentence-transformers, torch, mauve) are imported inside the functions
that need them, so importing this module is cheap.
"""

from fedsyn_server.evaluation.alignment import (
                                                 MAUVE_MISSING,
                                                 allocation_error,
                                                 frechet_distance,
                                                 knn_precision_recall,
                                                 mauve_available,
                                                 mauve_score,
)
from fedsyn_server.evaluation.report import format_report
from fedsyn_server.evaluation.sets import DEFAULT_EMBEDDER, JOINT_LABEL, evaluate_files, evaluate_sets, write_evaluation
from fedsyn_server.evaluation.utility import (
                                                 CLASSIFIERS,
                                                 MIN_TEST_ROWS,
                                                 downstream_utility,
                                                 label_agreement,
                                                 transformer_utility,
                                                 utility_warnings,
)

__all__ = [
    "CLASSIFIERS", "DEFAULT_EMBEDDER", "JOINT_LABEL", "MAUVE_MISSING", "MIN_TEST_ROWS",
    "allocation_error", "downstream_utility", "evaluate_files", "evaluate_sets", "format_report",
    "frechet_distance", "knn_precision_recall", "label_agreement", "mauve_available", "mauve_score",
    "transformer_utility", "utility_warnings", "write_evaluation",
]
