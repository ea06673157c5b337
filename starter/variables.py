"""The base of the client's own settings: read from their variables only.

A client runs in someone's shell, among other tools' `.env` files and secrets directories:
its settings come from the variables their fields name (case-sensitive; empty counts as unset)
and from code, nothing else. (The worker's settings, which can also come from the stack file,
are `activities.settings.EnvSettings`.)
"""

from __future__ import annotations

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class VariablesOnly(BaseSettings):
    model_config = SettingsConfigDict(
        extra="forbid", frozen=True, case_sensitive=True, env_ignore_empty=True
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings)
