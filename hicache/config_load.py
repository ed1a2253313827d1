"""Loading a configuration, whatever its sections: :class:`ConfigError`, text to field types, environment
overrides and whom an error is blamed on, merging, and the YAML file.

The node's sections are :mod:`hicache.config`'s and the router's :mod:`hicache.router.config`'s; both build
them with what is here:

* :func:`read_config_file`: the sections of a YAML file, or one line naming the file (and the line and
  column of a syntax error);
* :func:`env_overrides` / :func:`env_sources`: ``HICACHE_<SECTION>__<FIELD>`` variables as sections of
  text, and which variable set each field;
* :func:`merge`: sections laid over each other, later ones winning;
* :func:`coerce` / :func:`build_section`: YAML or environment text to a field's type, and a section's
  dataclass from plain values; an unknown field or a bad value is a :class:`ConfigError` naming it;
* :func:`blame_env`: an error about a field an environment variable set, prefixed with that variable (its
  value hidden when it may hold a credential).

:class:`ConfigError` lives here, below the dataclasses that raise it too; import it from
:mod:`hicache.config`, as the rest of the code base does.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "HICACHE_"
# a credential, in a variable's name (a misspelt one too: AUTHTOKEN) or in its value (a mapping with a
# password key); "tokens" (counts of tokens: l1_tokens) is not one
_SECRET = re.compile(r"token(?!s)|passw|secret|credential", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(://)[^/\s]*@")  # scheme://user:password@host


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field.

    ``field`` is the dotted name the error is about (``cache.l1_tokens``, ``cache.transfer_options.blocks``,
    or a section such as ``cache``). Messages start with it, so when it is not given it is read from there.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field if field is not None else message.partition(":")[0].strip()


def require(cond: bool, fieldname: str, allowed: str, value: Any) -> None:
    """:class:`ConfigError` ``fieldname: must be allowed, got value`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{fieldname}: must be {allowed}, got {value!r}", fieldname)


def coerce(section: str, name: str, tp: Any, value: Any) -> Any:
    """Convert YAML / env text to the field's type, or raise ConfigError naming the field."""
    where = f"{section}.{name}"
    origin = typing.get_origin(tp)
    if origin in (dict, Mapping) or tp is dict:
        # text naming a credential (storage.options: {sentinel_password: ...}) is not quoted back
        secret = isinstance(value, str) and _SECRET.search(value) is not None
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as e:
                problem = getattr(e, "problem", None) or type(e).__name__
                raise ConfigError(f"{where}: must be a mapping, got {'<hidden>' if secret else value!r} "
                                  f"(not valid YAML: {problem})",
                                  where) from None
        require(isinstance(value, dict), where, "a mapping", "<hidden>" if secret else value)
        return dict(value)
    if isinstance(origin, type) and issubclass(origin, types.UnionType):  # pragma: no cover
        return value
    if tp is bool:
        if isinstance(value, str):
            low = value.strip().lower()
            require(low in ("1", "0", "true", "false", "yes", "no", "on", "off"), where, "a boolean", value)
            return low in ("1", "true", "yes", "on")
        require(isinstance(value, bool), where, "a boolean", value)
        return value
    if tp is int:
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""), 0)
            except ValueError:
                raise ConfigError(f"{where}: must be an integer, got {value!r}") from None
        require(isinstance(value, int) and not isinstance(value, bool), where, "an integer", value)
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{where}: must be a number, got {value!r}") from None
        require(isinstance(value, int | float) and not isinstance(value, bool), where, "a number", value)
        return float(value)
    if tp is str:
        require(isinstance(value, str), where, "a string", value)
        return value
    return value


def build_section(cls: type, section: str, values: Mapping[str, Any]) -> Any:
    """The dataclass ``cls`` of section ``section`` from plain values (:func:`coerce` each)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        if name not in known:
            raise ConfigError(f"{section}.{name}: unknown field; known: {sorted(known)}")
        kwargs[name] = coerce(section, name, hints[name], value)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{section}: {e}") from e


def env_overrides(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """``HICACHE_CACHE__L1_TOKENS=4096`` -> ``{"cache": {"l1_tokens": "4096"}}``."""
    out: dict[str, dict[str, str]] = {}
    for k, v in env.items():
        if not k.startswith(ENV_PREFIX) or "__" not in k:
            continue
        section, _, name = k[len(ENV_PREFIX):].partition("__")
        out.setdefault(section.lower(), {})[name.lower()] = v
    return out


def env_sources(env: Mapping[str, str]) -> dict[str, str]:
    """Which environment variable set each field: ``{"cache.l1_tokens": "HICACHE_CACHE__L1_TOKENS"}``
    (the keys as :func:`env_overrides` reads them: lower case, ``section.field``)."""
    out: dict[str, str] = {}
    for k in env:
        if k.startswith(ENV_PREFIX) and "__" in k:
            section, _, name = k[len(ENV_PREFIX):].partition("__")
            out[f"{section.lower()}.{name.lower()}"] = k
    return out


def _shown(value: str, limit: int = 80) -> str:
    """An environment value as an error message quotes it: as is when short and printable (one line),
    else its ``repr``, cut to ``limit`` characters."""
    if value.isprintable() and value.strip() == value and value and len(value) <= limit:
        return value
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def blame_env(error: ConfigError, env: Mapping[str, str], overrides: Mapping[str, Mapping[str, Any]] | None = None,
              file_sections: Collection[str] = ()) -> ConfigError:
    """``error`` prefixed with ``VAR=value: `` when what it is about came from the environment variable
    ``VAR``; otherwise ``error`` itself.

    A field's own error (``cache.l1_tokens``) or one inside it (``cache.transfer_options.blocks``) is
    blamed on the variable that set the field, unless an explicit override (a flag) replaced it. A
    section's error (an unknown section ``cachex``) is blamed on the first variable naming that section,
    unless the config file (``file_sections``) or an override names the section too. A value that may
    hold a credential is not repeated: one whose variable or text names a token, password or secret
    (``<hidden>``), and the ``user:password@`` of a URL (``<hidden>@``), so a misspelt
    ``HICACHE_STORAGE__URI=redis://:pw@host`` does not print the password.
    """
    field = error.field
    overrides = overrides or {}
    sources = env_sources(env)
    var = None
    if "." in field:
        for key, name in sources.items():
            section, _, fname = key.partition(".")
            if (field == key or field.startswith(key + ".")) and fname not in overrides.get(section, {}):
                var = name
                break
    elif field not in file_sections and field not in overrides:
        var = next((name for key, name in sources.items() if key.partition(".")[0] == field), None)
    if var is None:
        return error
    value = env[var]
    secret = _SECRET.search(var[len(ENV_PREFIX):]) or _SECRET.search(value)
    shown = "<hidden>" if secret else _shown(_URL_USERINFO.sub(r"\1<hidden>@", value))
    return ConfigError(f"{var}={shown}: {error}", error.field)


def merge(base: Mapping[str, Any], *overlays: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Sections of ``base`` with each overlay's fields laid over them, later overlays winning (a copy);
    :class:`ConfigError` when a section of ``base`` is not a mapping."""
    for k, v in base.items():
        if v is not None and not isinstance(v, Mapping):
            raise ConfigError(f"{k}: must be a mapping, got {type(v).__name__}")
    out: dict[str, Any] = {k: dict(v or {}) for k, v in base.items()}
    for ov in overlays:
        for section, values in ov.items():
            out.setdefault(section, {}).update(values)
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The sections of a YAML config file; :class:`ConfigError` in one line naming the file (and the line and
    column of a YAML syntax error) when it cannot be read, is not UTF-8 text, is not YAML or is not a mapping."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start})") from None
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"config file {where}: not valid YAML ({problem})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping of sections")
    return loaded

