"""Mode "mooncake": Mooncake Store across nodes. `store` (MooncakeStore, the contract over
registered buffers), `binding` (import, codes, master health), `transfer` (objects with
a checksum trailer). Importing this package does not import Mooncake itself."""
