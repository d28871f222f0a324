"""`planner hardware list|show` and `planner models list|show` (filled in by the catalog work)."""

from __future__ import annotations
