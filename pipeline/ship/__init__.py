"""Segments off the GPU node: the object store (`store`), the `stepledger ship` sidecar
(`shipper`) and a SeaweedFS S3 server for tests and one-machine stacks (`s3server`)."""
