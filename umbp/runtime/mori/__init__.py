"""Mode "mori": AMD's MORI UMBP. `store` (MoriStore: checksum sidecars, batches, bounce
buffers), `binding` (import, a client per deployment, registration, version defects).
Importing this package does not import MORI itself."""
