"""Where a setting's value comes from, written once for every settings class.

Highest first: a value passed in code (a command-line option, a test), the variable its field
names, a file, the field's default. The file is the production file DURABLE_COMFY_SETTINGS_FILE
names (the keys a class's `file_keys` maps) or, for the worker's settings on the dev stack, the
`worker:` section of the stack file DURABLE_COMFY_CONFIG names; a worker refuses both.

The rules every class follows:
- only the variables a class's fields name (their validation aliases) are read, case-sensitive,
  from the process's environment or the mapping `Settings.from_env` was given; no `.env` file,
  no secrets directory, no field name;
- an empty variable counts as unset (an alias list then tries its next name); nothing is
  stripped, and a variable's value stays a string for the field's own parser (never JSON-decoded
  on the way: a list variable is comma-separated, DURABLE_COMFY_POOLS parses its own JSON), keyed
  by the variable's name so an error names it;
- a field takes its value from one source only: a lower one never merges into a higher one's
  (DURABLE_COMFY_POOLS replaces the file's pools).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, Self

import yaml
from pydantic import AliasChoices, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from configuration.errors import FILE_VAR, ConfigFileError
from configuration.files import CONFIG_VAR, WorkerSection, load_config_file, read_worker_section

# The environment `Settings.from_env` was given; None: the process's own.
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("durable_comfy_environ", default=None)


def current_environ() -> Mapping[str, str]:
    """The environment settings are being read from: `from_env`'s mapping, else the process's
    (the one place of the product that reads the process's environment)."""
    environ = _ENVIRON.get()
    return os.environ if environ is None else environ


def variable_names(field: FieldInfo) -> list[str]:
    """The variables a field is read from, in order: its validation alias(es)."""
    alias = field.validation_alias
    if isinstance(alias, str):
        return [alias]
    if isinstance(alias, AliasChoices):
        return [choice for choice in alias.choices if isinstance(choice, str)]
    return []


def taken(state: Mapping[str, Any], name: str, field: FieldInfo) -> bool:
    """Whether a higher source already gave this field (under its name or a variable's)."""
    return name in state or any(var in state for var in variable_names(field))


class Variables(PydanticBaseSettingsSource):
    """The variables a settings class names (its fields' aliases), and nothing else.

    Values stay strings for pydantic to parse, keyed by the variable's name, so an error names
    the variable. A field a higher source (code) already set is left alone: sources never merge.
    """

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self._environ = environ

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        for name in variable_names(field):
            value = self._environ.get(name)
            if value:  # an empty variable counts as unset
                return value, name, False
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, field in self.settings_cls.model_fields.items():
            if taken(self.current_state, name, field):
                continue
            value, key, _ = self.get_field_value(field, name)
            if value is not None:
                values[key] = value
        return values


@contextmanager
def _reading(what: str) -> Iterator[None]:
    try:
        yield
    except (OSError, ValueError, yaml.YAMLError) as exc:  # ValidationError is a ValueError
        raise SettingsError(f"{what}: {exc}") from exc


class StackFileSection(PydanticBaseSettingsSource):
    """The `worker:` section of the file DURABLE_COMFY_CONFIG names, below the variables."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # everything happens in __call__

    def __call__(self) -> dict[str, Any]:
        state = self.current_state
        path = state.get(CONFIG_VAR) or state.get("config_file")
        if not path:
            return {}
        with _reading(f"{CONFIG_VAR}={path}"):
            section = read_worker_section(Path(path))
        fields = self.settings_cls.model_fields
        return {
            name: getattr(section, name)
            for name in WorkerSection.model_fields
            if not taken(state, name, fields[name]) and getattr(section, name) is not None
        }


class ProductionFile(PydanticBaseSettingsSource):
    """The production file's values for the fields `file_keys` maps, below the variables.

    The file is the one DURABLE_COMFY_SETTINGS_FILE names (or a `settings_file` given in code).
    A field a higher source (code, a variable) gave is left alone. `exclusive`: the class's
    fields are one setting (the codec's key ring: literal keys or a key file), so the file gives
    nothing once a higher source gave any of them. A bad file is a `ValidationError` located at
    DURABLE_COMFY_SETTINGS_FILE.
    """

    def __init__(
        self,
        settings_cls: type[BaseSettings],
        file_keys: Mapping[str, str],
        exclusive: bool,
        environ: Mapping[str, str],
    ) -> None:
        super().__init__(settings_cls)
        self._keys = file_keys
        self._exclusive = exclusive
        self._environ = environ

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # everything happens in __call__

    def __call__(self) -> dict[str, Any]:
        if not self._keys:
            return {}
        state = self.current_state
        path = state.get("settings_file") or state.get(FILE_VAR) or self._environ.get(FILE_VAR)
        if not path:
            return {}
        try:
            config = load_config_file(Path(path))
        except ConfigFileError as exc:
            raise exc.as_validation_error(self.settings_cls.__name__) from exc
        fields = self.settings_cls.model_fields
        given = [name for name in fields if taken(state, name, fields[name])]
        if self._exclusive and given:
            return {}
        # Keyed as a variable would be (by the field's alias), as the variables' values are.
        return {
            (variable_names(fields[name]) or [name])[0]: value
            for name, key in self._keys.items()
            if name not in given and (value := config.value(key)) is not None
        }


class Settings(BaseSettings):
    """The base of every settings class: read from the variables its fields' aliases name, and
    from code by field name or variable name.

    `Cls()` reads the process's environment; `Cls.from_env(mapping)` reads that mapping instead
    (the local stack's `worker_env()`, a test's dict).
    """

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        validate_by_name=True,
        validate_by_alias=True,
        case_sensitive=True,
    )
    # Field -> dotted key in the production file (configuration.files); none: the file is not
    # read for this class.
    file_keys: ClassVar[Mapping[str, str]] = {}
    # The mapped fields are one setting: the file gives none once code or a variable gave one.
    file_keys_exclusive: ClassVar[bool] = False
    # Read the dev stack file's `worker:` section between the variables and the production file.
    reads_stack_file: ClassVar[bool] = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **values: Any) -> Self:
        """Build from `environ` (default: the process's environment); `values` win over it."""
        token = _ENVIRON.set(environ)
        try:
            return cls(**values)
        finally:
            _ENVIRON.reset(token)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        environ = current_environ()
        stack = (StackFileSection(settings_cls),) if cls.reads_stack_file else ()
        production = ProductionFile(settings_cls, cls.file_keys, cls.file_keys_exclusive, environ)
        return (init_settings, Variables(settings_cls, environ), *stack, production)


def problems(exc: ValidationError) -> str:
    """One line for a settings error: each problem with the variable (or field) it is about."""

    def one(error: Any) -> str:
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "missing":
            return f"{where} is not set"
        message = str(error["msg"]).removeprefix("Value error, ")
        return f"{where}: {message}" if where else message

    return "; ".join(one(error) for error in exc.errors())
