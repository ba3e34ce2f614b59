"""An import-linter contract type for the method packages: every module is pure unless named glue.

``lint-imports`` loads it from pyproject.toml (``contract_types``), from the repository root.
A stock ``forbidden`` contract checks the modules it lists, so a new pure module is unchecked
until someone remembers to add it. This contract inverts that: every module of ``packages`` is
checked (it imports none of ``forbidden_modules``, not even through another module), except the
ones listed in ``glue_modules``, the transport glue of each role (roles, exchanges,
coordinators, their metrics). The glue list cannot rot either: a listed module that does not
exist, or that no longer reaches a forbidden module, breaks the contract, so it must be taken
off the list and is checked from then on. ``ignore_imports`` does not exist here on purpose.
"""

from __future__ import annotations

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.domain.helpers import module_expressions_to_modules


class PureByDefaultContract(Contract):
    """Options: ``packages`` (every module in them is pure...), ``glue_modules`` (...except
    these), ``forbidden_modules`` (what pure means: none of these, directly or not)."""

    type_name = "pure_by_default"

    packages = fields.ListField(subfield=fields.ModuleExpressionField())
    glue_modules = fields.ListField(subfield=fields.ModuleExpressionField(), required=False)
    forbidden_modules = fields.ListField(subfield=fields.ModuleExpressionField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        packages = {m.name for m in module_expressions_to_modules(graph, self.packages, as_packages=True)}
        glue = {str(m) for m in self.glue_modules or ()}
        forbidden = [str(m) for m in self.forbidden_modules]
        stale = sorted(g for g in glue if g not in graph.modules)
        pure_glue = sorted(g for g in glue if g in graph.modules and not any(
            f in graph.modules and graph.chain_exists(importer=g, imported=f, as_packages=True) for f in forbidden))
        # module by module: a package's own __init__ is checked, not the glue below it
        pure = sorted(packages - glue)
        targets = sorted({t for f in forbidden if f in graph.modules
                          for t in {f, *(() if graph.is_module_squashed(f) else graph.find_descendants(f))}})
        forbidden_check = ForbiddenContract(self.name, self.session_options, {
            "source_modules": pure, "forbidden_modules": targets, "as_packages": "false"})
        inner = forbidden_check.check(graph, verbose)
        return ContractCheck(kept=inner.kept and not stale and not pure_glue, warnings=inner.warnings,
                             metadata={"inner": inner, "forbidden_check": forbidden_check, "stale": stale,
                                       "pure_glue": pure_glue, "forbidden": forbidden})

    def render_broken_contract(self, check: ContractCheck) -> None:
        meta = check.metadata
        for module in meta["stale"]:
            output.print_error(f"{module} is listed in glue_modules but does not exist: take it off the list.")
        for module in meta["pure_glue"]:
            output.print_error(f"{module} is listed in glue_modules but imports none of "
                               f"{', '.join(meta['forbidden'])}: it is pure, take it off the list so it is checked.")
        if meta["stale"] or meta["pure_glue"]:
            output.new_line()
        if not meta["inner"].kept:
            meta["forbidden_check"].render_broken_contract(meta["inner"])
