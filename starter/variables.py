"""The base of the client's own settings: their variables, then the production file.

A client runs in someone's shell, among other tools' `.env` files and secrets directories:
its settings come from code, the variables their fields name (case-sensitive; empty counts as
unset), and the production configuration file DURABLE_COMFY_SETTINGS_FILE names (the keys a
class's `file_keys` maps, below the variables; `activities.config_file`), nothing else. The
worker's settings, which can also come from the dev stack file, are
`activities.settings.EnvSettings`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from activities.config_file import ConfigFileSource


class VariablesOnly(BaseSettings):
    model_config = SettingsConfigDict(
        extra="forbid", frozen=True, case_sensitive=True, env_ignore_empty=True
    )
    # Field -> dotted key in the production file; none: the file is not read for this class.
    file_keys: ClassVar[Mapping[str, str]] = {}
    # The mapped fields are one setting: the file gives none once code or a variable gave one.
    file_keys_exclusive: ClassVar[bool] = False

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        production_file = ConfigFileSource(
            settings_cls, cls.file_keys, exclusive=cls.file_keys_exclusive
        )
        return (init_settings, env_settings, production_file)
