//! `--check`'s look at the database for the result cache's rules: a `query_contains` naming
//! a relation no database it applies to has is a rule that can never match, an error at its
//! line as a misspelt key is (the text alone cannot say; see
//! [`crate::config::cache::contained_names`]).
//!
//! It logs in as pgmemo's own role (as WAL invalidation and the catalog reads do) to each
//! database a rule applies to: its `database`, else every database the configuration names,
//! else every database the upstream server has. A database it cannot reach is a warning,
//! never an error: `--check` of a configuration for a server that is down still passes on
//! everything it can judge. pgmemo does not run it at start or RELOAD: it would log in to
//! every database of the server each time, and a rule is harmless where it matches nothing
//! (SHOW CACHE shows its hits).

use crate::app::App;
use crate::config::cache::{contained_names, ContainedName};
use crate::config::{Config, ConfigError};
use crate::server::ServerConn;
use std::collections::{BTreeMap, HashSet};

/// The relations and functions of a database, by name (what a query's `FROM` may name).
const NAMES_SQL: &str = "SELECT c.relname::text FROM pg_class c \
    WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f') \
    UNION SELECT p.proname::text FROM pg_proc p";

/// What the check found: errors (rules that can never match, located in the file) and
/// warnings (databases it could not read).
#[derive(Debug, Default)]
pub struct Findings {
    pub errors: Vec<ConfigError>,
    pub warnings: Vec<String>,
}

/// Checks the rules of `app`'s configuration against the databases they apply to.
pub async fn check(app: &App) -> Findings {
    let cfg = app.config.load_full();
    let mut found = Findings::default();
    let rules: Vec<(usize, Option<&str>, Vec<ContainedName>)> = cfg
        .cache
        .rules
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            let names = contained_names(r.query_contains.as_deref()?);
            (!names.is_empty()).then_some((i, r.database.as_deref(), names))
        })
        .collect();
    if !cfg.cache.enabled || rules.is_empty() {
        return found;
    }
    let mut every: Option<Vec<String>> = None;
    // Per database: its names, or None when it could not be read.
    let mut catalogs: BTreeMap<String, Option<HashSet<String>>> = BTreeMap::new();
    for (i, database, names) in rules {
        let databases = match database {
            Some(d) => vec![d.to_owned()],
            None => {
                if every.is_none() {
                    every = Some(databases(app, &cfg, &mut found).await);
                }
                every.clone().unwrap_or_default()
            }
        };
        for d in &databases {
            if !catalogs.contains_key(d) {
                let names = catalog_names(app, d).await;
                if let Err(e) = &names {
                    found.warnings.push(format!(
                        "cache.rules[{i}]: could not read database {d} to check the rule: {e}"
                    ));
                }
                catalogs.insert(d.clone(), names.ok());
            }
        }
        let read: Vec<(&str, &HashSet<String>)> = databases
            .iter()
            .filter_map(|d| Some((d.as_str(), catalogs.get(d)?.as_ref()?)))
            .collect();
        if read.is_empty() {
            continue;
        }
        for name in names {
            if !read.iter().any(|(_, known)| names_one(known, &name)) {
                let on: Vec<&str> = read.iter().map(|(d, _)| *d).collect();
                let error = ConfigError::invalid(
                    format!("cache.rules[{i}].query_contains"),
                    format!(
                        "names {}, and {} no relation or function {}: the rule can never match",
                        name.name,
                        match on.as_slice() {
                            [one] => format!("database {one} has"),
                            many => format!("databases {} have", many.join(", ")),
                        },
                        match name.open {
                            true => "whose name starts so",
                            false => "of that name",
                        },
                    ),
                );
                found.errors.push(cfg.locate(error));
            }
        }
    }
    found
}

/// Whether `known` (a database's relation and function names) has the one `name` stands for.
fn names_one(known: &HashSet<String>, name: &ContainedName) -> bool {
    let fold = |k: &String| match name.quoted {
        true => k.clone(),
        false => k.to_lowercase(),
    };
    match name.open {
        false => known.iter().any(|k| fold(k) == name.name),
        true => known.iter().any(|k| fold(k).starts_with(&name.name)),
    }
}

/// The databases a rule without `database` applies to: those the configuration names, else
/// every database of the upstream server that takes connections.
async fn databases(app: &App, cfg: &Config, found: &mut Findings) -> Vec<String> {
    let named: Vec<String> = cfg
        .databases
        .keys()
        .filter(|d| *d != "*")
        .cloned()
        .collect();
    if !named.is_empty() {
        return named;
    }
    let sql = "SELECT datname::text FROM pg_database WHERE datallowconn AND NOT datistemplate";
    match query(app, "postgres", sql).await {
        Ok(rows) => rows
            .into_iter()
            .filter_map(|mut r| r.pop().flatten())
            .collect(),
        Err(e) => {
            found.warnings.push(format!(
                "cache.rules: could not list the upstream's databases to check the rules: {e}"
            ));
            Vec::new()
        }
    }
}

async fn catalog_names(app: &App, database: &str) -> Result<HashSet<String>, String> {
    let rows = query(app, database, NAMES_SQL).await?;
    Ok(rows
        .into_iter()
        .filter_map(|mut r| r.pop().flatten())
        .collect())
}

/// Runs `sql` on `database` logged in as pgmemo's own role.
async fn query(app: &App, database: &str, sql: &str) -> Result<Vec<Vec<Option<String>>>, String> {
    let target = app
        .own_target(database)
        .ok_or_else(|| format!("the configuration does not serve database {database}"))?;
    let mut server = ServerConn::connect(&target)
        .await
        .map_err(|e| e.to_string())?;
    let rows = server.internal_query(sql).await.map_err(|e| e.to_string());
    server.terminate().await;
    rows
}
