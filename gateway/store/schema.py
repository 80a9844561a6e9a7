"""The schema version this memgate writes; stores opened on an older one are upgraded
in place (each backend's MIGRATIONS), a newer one is refused."""

SCHEMA_VERSION = 1
