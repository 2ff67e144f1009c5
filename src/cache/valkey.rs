//! How pgmemo reaches the shared tier's Valkey (or Redis): one server, or a cluster
//! (`[cache.shared] cluster = true`: the URL names a node, the others are found from it),
//! over TCP or TLS (`rediss://`, with the system's roots or `ca_file`'s). Connections come
//! from the `redis` crate; [`Conn`] lets the tier and the fleet's decoder send the same
//! commands to either (a key's commands all go to the node of its slot: each command and
//! pipeline here names one key).

use crate::config::cache::SharedTier;
use std::time::Duration;

/// A server or a cluster (each boxed: a cluster's client is twice a server's).
#[derive(Clone)]
pub enum Valkey {
    One(Box<redis::Client>),
    Cluster(Box<redis::cluster::ClusterClient>),
}

/// A connection to either.
#[derive(Clone)]
pub enum Conn {
    /// One server, reconnected by itself when it breaks ([`Valkey::lasting`]).
    Managed(redis::aio::ConnectionManager),
    /// One server, a connection of its own ([`Valkey::connect`]).
    One(redis::aio::MultiplexedConnection),
    /// A cluster (it follows the cluster's nodes and reconnects by itself).
    Cluster(redis::cluster_async::ClusterConnection),
}

/// How long a connection waits to be made.
const CONNECT: Duration = Duration::from_secs(1);

impl Valkey {
    pub fn new(config: &SharedTier) -> Result<Valkey, String> {
        let certs = match &config.ca_file {
            Some(path) => Some(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(
                    std::fs::read(path)
                        .map_err(|e| format!("cache.shared.ca_file {}: {e}", path.display()))?,
                ),
            }),
            None => None,
        };
        let url = config.url.as_str();
        let bad = |e: redis::RedisError| format!("cache.shared.url: {e}");
        if config.cluster {
            let mut builder = redis::cluster::ClusterClient::builder(vec![url])
                .connection_timeout(CONNECT)
                .response_timeout(Duration::from_secs(1));
            if let Some(certs) = certs {
                builder = builder.certs(certs);
            }
            return builder
                .build()
                .map(|c| Valkey::Cluster(Box::new(c)))
                .map_err(bad);
        }
        match certs {
            Some(certs) => redis::Client::build_with_tls(url, certs),
            None => redis::Client::open(url),
        }
        .map(|c| Valkey::One(Box::new(c)))
        .map_err(bad)
    }

    /// A connection that stays, for commands that answer at once (each waits at most
    /// `response`): one server's is remade when it breaks, a cluster's follows its nodes.
    pub async fn lasting(&self, response: Duration) -> Result<Conn, String> {
        match self {
            Valkey::One(client) => {
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(CONNECT))
                    .set_response_timeout(Some(response))
                    .set_number_of_retries(1);
                redis::aio::ConnectionManager::new_lazy_with_config(*client.clone(), config)
                    .map(Conn::Managed)
                    .map_err(|e| format!("Valkey: {e}"))
            }
            Valkey::Cluster(_) => self.connect(response).await,
        }
    }

    /// A connection of its own (a blocking read must not hold up other commands), whose
    /// commands wait at most `response`.
    pub async fn connect(&self, response: Duration) -> Result<Conn, String> {
        match self {
            Valkey::One(client) => {
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECT))
                    .set_response_timeout(Some(response));
                client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map(Conn::One)
            }
            Valkey::Cluster(client) => {
                let config = redis::cluster::ClusterConfig::new()
                    .set_connection_timeout(CONNECT)
                    .set_response_timeout(response);
                client
                    .get_async_connection_with_config(config)
                    .await
                    .map(Conn::Cluster)
            }
        }
        .map_err(|e| format!("Valkey: {e}"))
    }
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Managed(c) => c.req_packed_command(cmd),
            Conn::One(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Managed(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::One(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Managed(c) => c.get_db(),
            Conn::One(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}
