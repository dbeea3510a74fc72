"""Adapters as data, and the registry that finds them by framework name.

An adapter module (``grpo_patches.adapters.<name>``, or a third party's module declared under
the ``grpo_patches.adapters`` entry-point group) exposes ``ADAPTER``: the framework's name,
its supported range (written once), how to read the installed version, and its patch table.
Looking an adapter up imports the adapter module only, never the framework.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable, Mapping, Sequence

from packaging.version import InvalidVersion, Version

from grpo_patches.errors import UnknownFrameworkError, UnsupportedFrameworkError
from grpo_patches.options import OPTIMIZATIONS, Options
from grpo_patches.patching import PatchTarget

#: Built-in adapters: framework name -> module exposing ``ADAPTER``.
BUILTIN: dict[str, str] = {
    "trl": "grpo_patches.adapters.trl",
    "verl": "grpo_patches.adapters.verl",
    "nemo_rl": "grpo_patches.adapters.nemo_rl",
    "open_instruct": "grpo_patches.adapters.open_instruct",
}

#: Entry-point group through which other distributions declare adapters (``name = module:ADAPTER``).
ADAPTER_GROUP = "grpo_patches.adapters"


@dataclass(frozen=True)
class Adapter:
    """A framework's adapter: one patch table for every supported version.

    :ivar name: the name users pass to :func:`grpo_patches.enable` (``"trl"``).
    :ivar distribution: the distribution whose installed version is read (``"trl"``).
    :ivar supported: PEP 440 range the adapter supports (``">=0.20,<1.17"``), written once.
    :ivar patches: the patch table: every record, each narrowing ``supported`` with its own
        ``versions`` where the framework's internals differ between versions.
    :ivar not_applicable: optimizations (:data:`~grpo_patches.options.OPTIMIZATIONS`) that
        have no effect of their own in this framework, each with what it does there instead.
        They are accepted (one meaning per option: never silently ignored); ``status()`` lists
        them under ``not_applicable`` and shows the text as the option's note.
    :ivar read_version: how to read the installed version when the distribution's metadata
        does not hold it (a framework run from a source checkout); returns ``None`` when the
        framework is not installed. Default: ``importlib.metadata.version(distribution)``.
    :ivar description: why the adapter has no records (shown when it cannot be enabled).
    :ivar version_origin: how ``read_version`` found the number (e.g. a source file, and why
        it was corrected), shown by ``status()``; ``None`` when the metadata is read.
    :ivar versions_text: the supported range as the README states it to users (``"0.20 - 1.16"``);
        ``status()`` shows it next to :attr:`supported`. Default: :attr:`supported`.
    :ivar install_hint: how to install a supported version, as the errors suggest it; default
        ``pip install '<distribution><supported>'``.
    """

    name: str
    distribution: str
    supported: str
    patches: Sequence[PatchTarget]
    not_applicable: Mapping[str, str] = field(default_factory=dict, hash=False)
    read_version: Callable[[], str | None] | None = None
    description: str = ""
    version_origin: Callable[[], str | None] | None = None
    versions_text: str = ""
    install_hint: str = ""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.not_applicable) - set(OPTIMIZATIONS))
        if unknown:
            raise ValueError(f"{self.name}: not_applicable names {unknown}; optimizations are {', '.join(OPTIMIZATIONS)}")

    @property
    def shown_range(self) -> str:
        """The supported range in users' words (:attr:`versions_text`, else the PEP 440 range)."""
        return self.versions_text or self.supported

    @property
    def how_to_install(self) -> str:
        """The install command the errors suggest (:attr:`install_hint`, else pip's)."""
        return self.install_hint or f"pip install '{self.distribution}{self.supported}'"

    def installed_version(self) -> Version | None:
        """The installed framework's version, ``None`` when it is not installed."""
        if self.read_version is not None:
            text = self.read_version()
        else:
            try:
                text = metadata.version(self.distribution)
            except metadata.PackageNotFoundError:
                text = None
        if text is None:
            return None
        try:
            return Version(text)
        except InvalidVersion:
            raise UnsupportedFrameworkError(f"{self.name}: cannot read the installed version {text!r}") from None

    def targets(self, version: Version) -> list[PatchTarget]:
        """Every record that exists for ``version`` (whatever the options)."""
        return [t for t in self.patches if t.applies_to(version)]

    def inapplicable(self, version: Version) -> dict[str, str]:
        """Optimizations with no effect at ``version``, each with why: the declared
        :attr:`not_applicable` ones, and those whose records all exist for other versions only
        (e.g. a loss path checked on one release)."""
        found = {option: f"not applicable: {why}" for option, why in self.not_applicable.items()}
        here = {t.option for t in self.targets(version)}
        for option in dict.fromkeys(t.option for t in self.patches if t.option):
            if option not in here and option not in found:
                ranges = " or ".join(sorted({t.versions or self.supported for t in self.patches if t.option == option}))
                found[option] = f"{option} needs {self.name} {ranges}; {version} is installed"
        return found

    def select(self, version: Version, options: Options, strict: bool = True) -> tuple[list[PatchTarget], dict[str, str]]:
        """The records to apply for ``options``, and notes on options that cannot run here.

        A declared :attr:`not_applicable` option is noted whatever its value. An option that
        is on but has records only for other versions is an error when set to ``True``, and a
        note (the optimization stays off) when it is on by default or ``"auto"``. ``verify_every``
        set for an adapter without verify records is an error (``strict``: the framework was named)
        or a note (``enable("all", ...)``): never a run that looks verified and is not.

        :raises UnsupportedFrameworkError: naming the option, version and ranges.
        """
        notes: dict[str, str] = {}
        for option, text in self.inapplicable(version).items():
            value = getattr(options, option)
            if option in self.not_applicable:
                notes[option] = text
            elif value is True and option not in _ON_BY_DEFAULT:
                raise UnsupportedFrameworkError(
                    f"{self.name} {version}: {text}. Install such a version or pass {option}=False "
                    "to grpo_patches.enable(...)"
                )
            elif value not in (False, None):
                notes[option] = f"off: {text}"
        declared = {t.option for t in self.patches}
        for option in OPTIMIZATIONS:  # an opt-in optimization asked of an adapter without it (e.g. pack_kept_rows)
            value = getattr(options, option)
            if option in declared or option in self.not_applicable or value is False or option not in _OPT_IN:
                continue
            text = f"{option} is not available for {self.name} yet"
            if value is True:
                raise UnsupportedFrameworkError(f"{self.name} {version}: {text}. Pass {option}=False to "
                                                "grpo_patches.enable(...)")
            notes[option] = f"off: {text}"
        if options.verify_every is not None and not any(t.option == "verify_every" for t in self.targets(version)):
            text = f"verify mode is not available for {self.name} {version} yet: no check would run"
            covered = sorted({t.versions or self.supported for t in self.patches if t.option == "verify_every"})
            where = f"it covers {self.name} {' and '.join(covered)}" if covered else "TRL has it"
            if strict:
                raise UnsupportedFrameworkError(
                    f"{self.name} {version}: verify_every={options.verify_every} asks for verify mode, which is not "
                    f"available for {self.name} {version} yet ({where}). Pass verify_every=None (the default) "
                    f"for {self.name}"
                )
            notes["verify_every"] = f"off: {text}"
        chosen = [t for t in self.targets(version)
                  if t.option is None or getattr(options, t.option) not in (False, None)]
        return chosen, notes


#: Options that are ``True`` by default: an unsupported version turns them off with a note.
_ON_BY_DEFAULT = tuple(name for name, value in Options().as_dict().items() if value is True)
#: Optimizations that are off by default: asked of an adapter that has no record for them, an error
#: (``True``) or a note (``"auto"``), never a silent no-op.
_OPT_IN = tuple(name for name in OPTIMIZATIONS if getattr(Options(), name) is False)


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ADAPTER_GROUP)}


def names() -> list[str]:
    """Every framework name ``enable`` accepts (besides ``"all"``)."""
    return list(dict.fromkeys([*BUILTIN, *_entry_points()]))


def get(name: str) -> Adapter:
    """The adapter for ``name``; :class:`UnknownFrameworkError` listing the valid names."""
    if name in BUILTIN:
        return importlib.import_module(BUILTIN[name]).ADAPTER
    eps = _entry_points()
    if name in eps:
        return eps[name].load()
    valid = ", ".join([*names(), "all"])
    raise UnknownFrameworkError(f"unknown framework {name!r}; valid names are: {valid}")
