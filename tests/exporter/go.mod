module pgmemo/tests/exporter

go 1.25.0

require github.com/lib/pq v1.12.3
