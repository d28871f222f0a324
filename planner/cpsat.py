"""A small 0-1/integer linear program solved by OR-Tools CP-SAT, deterministically (one worker, fixed seed).

The planner's programs have a few dozen variables, so the cost that matters is importing OR-Tools: the public
`ortools.sat.python.cp_model` module imports pandas (about 0.7 s on a small machine). When the installed
OR-Tools exposes its C++ model proto to Python (`cp_model_helper.CpModelProto`, OR-Tools >= 9.12), the
program is written straight into that proto and solved with `cp_model_helper.SolveWrapper` (about 0.15 s to
import); older versions go through the public API. Both paths build the same model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEED = 20240611  # fixed CP-SAT seed: the same program gives the same answer on every run
INT_MAX = 2**62


@dataclass
class Program:
    """Integer variables with bounds, linear constraints lb <= sum(c*x) <= ub, and a linear objective (min)."""

    bounds: list[tuple[int, int]] = field(default_factory=list)
    constraints: list[tuple[list[tuple[int, int]], int, int]] = field(default_factory=list)
    objective: list[tuple[int, int]] = field(default_factory=list)
    offset: int = 0

    def bool(self) -> int:
        return self.int(0, 1)

    def int(self, lb: int, ub: int) -> int:
        self.bounds.append((int(lb), int(ub)))
        return len(self.bounds) - 1

    def fix(self, var: int, value: int) -> None:
        self.bounds[var] = (int(value), int(value))

    def add(self, terms: list[tuple[int, int]], lb: int = -INT_MAX, ub: int = INT_MAX) -> None:
        """lb <= sum(coef * var) <= ub; terms are (var, coef) pairs."""
        self.constraints.append(([(v, int(c)) for v, c in terms if c], int(lb), int(ub)))

    def minimize(self, terms: list[tuple[int, int]], offset: int = 0) -> None:
        self.objective = [(v, int(c)) for v, c in terms if c]
        self.offset = int(offset)

    def value(self, values: list[int]) -> int:
        """The objective at an assignment."""
        return self.offset + sum(c * values[v] for v, c in self.objective)

    def solve(self, time_limit_s: float = 10.0) -> list[int] | None:
        """An optimal assignment, or None when the program is infeasible."""
        try:
            from ortools.sat.python import cp_model_helper as cmh
        except ImportError:  # pragma: no cover - OR-Tools without the helper module
            cmh = None
        if cmh is not None and hasattr(cmh, "CpModelProto") and hasattr(cmh, "SolveWrapper"):
            return self._solve_proto(cmh, time_limit_s)
        return self._solve_public(time_limit_s)  # pragma: no cover - older OR-Tools

    def _solve_proto(self, cmh, time_limit_s: float) -> list[int] | None:
        proto = cmh.CpModelProto()
        for lb, ub in self.bounds:
            proto.variables.add().domain.extend([lb, ub])
        for terms, lb, ub in self.constraints:
            lin = proto.constraints.add().linear
            lin.vars.extend([v for v, _ in terms])
            lin.coeffs.extend([c for _, c in terms])
            lin.domain.extend([lb, ub])
        proto.objective.vars.extend([v for v, _ in self.objective])
        proto.objective.coeffs.extend([c for _, c in self.objective])
        params = cmh.SatParameters()
        params.num_workers = 1
        params.random_seed = SEED
        params.max_time_in_seconds = time_limit_s
        params.cp_model_presolve = False  # programs of ~25 variables: presolve costs more than it saves
        params.linearization_level = 0
        solver = cmh.SolveWrapper()
        solver.set_parameters(params)
        response = solver.solve(proto)
        if response.status == cmh.CpSolverStatus.MODEL_INVALID:
            raise RuntimeError(f"CP-SAT rejected the program: {cmh.CpSatHelper.validate_model(proto)}")
        if response.status not in (cmh.CpSolverStatus.OPTIMAL, cmh.CpSolverStatus.FEASIBLE):
            return None
        return [int(x) for x in response.solution]

    def _solve_public(self, time_limit_s: float) -> list[int] | None:
        from ortools.sat.python import cp_model

        model = cp_model.CpModel()
        xs = [model.new_int_var(lb, ub, f"x{i}") for i, (lb, ub) in enumerate(self.bounds)]
        for terms, lb, ub in self.constraints:
            model.add_linear_constraint(sum(c * xs[v] for v, c in terms), lb, ub)
        model.minimize(sum(c * xs[v] for v, c in self.objective))
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = SEED
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.cp_model_presolve = False
        solver.parameters.linearization_level = 0
        status = solver.solve(model)
        if status == cp_model.MODEL_INVALID:
            raise RuntimeError(f"CP-SAT rejected the program: {model.validate()}")
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return [int(solver.value(x)) for x in xs]
