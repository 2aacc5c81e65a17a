"""See what probehook read: each token of a request coloured by a score, with everything
about it under the pointer (:func:`view`); inline in a notebook, as a file, or for CircuitsVis.
See docs/viewer.md."""

from probehook.viewer.page import View, view

__all__ = ["View", "view"]
