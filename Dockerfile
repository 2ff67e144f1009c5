# pgmemo in a container: a Rust build stage and a small Debian runtime, running as the
# unprivileged user pgmemo. See docs/operations.md, "Docker".
#
#   docker build -t pgmemo .
#   docker run -p 6432:6432 -e PGMEMO_UPSTREAM=postgresql://app:secret@db:5432 pgmemo
#   docker run -p 6432:6432 -v "$PWD/pgmemo.toml:/etc/pgmemo/pgmemo.toml:ro" \
#       -e PGMEMO_CONFIG=/etc/pgmemo/pgmemo.toml pgmemo
#
# Every flag has a PGMEMO_* variable (pgmemo --help lists them); flags and variables override
# the file. The image listens on 0.0.0.0:6432 (PGMEMO_LISTEN), which pgmemo allows only with
# password authentication (scram-sha-256 by default, or md5).

FROM rust:1-bookworm AS build
# libclang: the pg_query crate (PostgreSQL's parser) generates its bindings with bindgen.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libclang-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin pgmemo

# The same Debian release as the builder, so the binary finds the glibc it was linked with.
FROM debian:bookworm-slim
RUN groupadd --system pgmemo \
    && useradd --system --gid pgmemo --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin pgmemo
COPY --from=build /src/target/release/pgmemo /usr/local/bin/pgmemo
COPY pgmemo.example.toml /etc/pgmemo/pgmemo.example.toml
COPY LICENSE-MIT LICENSE-APACHE /usr/share/doc/pgmemo/
USER pgmemo
ENV PGMEMO_LISTEN=0.0.0.0:6432
EXPOSE 6432
# SIGINT shuts down safely, waiting up to general.shutdown_timeout (30 s) for running
# transactions: give docker stop a longer --time than that. (SIGTERM would wait for every
# client to disconnect, as PgBouncer's does.)
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/pgmemo"]
