"""Expected errors: what a user typed or fed was wrong, and the message says how to fix it.

Everything a user can cause (a bad config, bad data, a missing or broken checkpoint, a
verifier that cannot be found) raises one of these. The CLI prints them in one or two
lines without a traceback (``MMRL_DEBUG=1`` or ``--debug`` shows it); any other exception
is a bug in mmrl and keeps its traceback.

Each class also derives from the built-in exception that code catching errors expects
(``ValueError``, ``FileNotFoundError``), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable


class MMRLError(Exception):
    """An expected error: ``what`` went wrong, ``where`` (file, sample, config key), the ``fix``."""

    def __init__(self, what: str, where: str | None = None, fix: str | None = None) -> None:
        self.what, self.where, self.fix = what, where, fix
        super().__init__(self.short())

    def short(self) -> str:
        """The one- or two-line form the CLI prints."""
        line = f"{self.where}: {self.what}" if self.where else self.what
        return f"{line}\n  fix: {self.fix}" if self.fix else line

    def at(self, where: str) -> MMRLError:
        """The same error with ``where`` prefixed (e.g. the worker rank it was raised on)."""
        inner = f"{where}, {self.where}" if self.where else where
        return self._copy(where=inner)

    def _copy(self, **changes: str | None) -> MMRLError:
        fields = {"what": self.what, "where": self.where, "fix": self.fix, **changes}
        return type(self)(fields["what"], fields["where"], fields["fix"])

    def __reduce__(self):  # keyword-free, so the error crosses process (Ray) boundaries intact
        return type(self), (self.what, self.where, self.fix)


class ConfigError(MMRLError, ValueError):
    """One or more problems in a run's config; each names the key's full path.

    ``problems`` holds one line per problem, e.g.
    ``"actor_rollout_ref.rollout.n=0: must be >= 1"``. All of a config's problems are
    collected and raised together, so a user sees every one of them at once.
    """

    def __init__(
        self,
        problems: str | Iterable[str],
        where: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        what = (
            self.problems[0]
            if len(self.problems) == 1
            else f"{len(self.problems)} problems in the config:\n"
            + "\n".join(f"  - {p}" for p in self.problems)
        )
        MMRLError.__init__(self, what, where, fix)

    def _copy(self, **changes: str | None) -> MMRLError:
        fields = {"where": self.where, "fix": self.fix, **changes}
        return ConfigError(self.problems, fields["where"], fields["fix"])

    def __reduce__(self):
        return type(self), (self.problems, self.where, self.fix)


class DataError(MMRLError, ValueError):
    """A dataset, sample or media file cannot be used (malformed, corrupt, out of bounds)."""


class DataNotFoundError(MMRLError, FileNotFoundError):
    """A data folder the config names is missing or holds nothing of the kind asked for."""


class CheckpointError(MMRLError, FileNotFoundError):
    """A model or checkpoint folder is missing, incomplete or of the wrong kind."""


class VerifierError(MMRLError, ValueError):
    """A verifier cannot be found or used as configured (a bug in a verifier stays its own
    error)."""


__all__ = ["CheckpointError", "ConfigError", "DataError", "MMRLError", "VerifierError"]
