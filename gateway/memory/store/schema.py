"""The schema version this memgate writes; stores opened on an older one are upgraded
in place (each backend's MIGRATIONS), a newer one is refused.

    1  memory ids unique across the whole store
    2  memory ids unique per tenant: a tenant's id never collides with another's
"""

SCHEMA_VERSION = 2
