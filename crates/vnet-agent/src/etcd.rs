//! How an agent reaches etcd: the command-line arguments every subcommand
//! shares, and the client connection (TLS when given certificates, as an
//! etcd user when given one).

use anyhow::{Context, Result};
use std::path::PathBuf;
use std::time::Duration;

/// The longest the agent waits for a short answer (a lease keep-alive's).
pub const OP_TIMEOUT: Duration = Duration::from_secs(3);
/// The longest one request may take: a listing of a 1,000-host overlay
/// from a cluster under a whole overlay's bring-up takes seconds, and a
/// request given up is a listing started again.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Where etcd is, and how to reach it.
#[derive(clap::Args, Debug, Clone)]
pub struct EtcdArgs {
    /// etcd endpoints, comma-separated (http://127.0.0.1:2379 or https://...).
    #[arg(long = "etcd", value_delimiter = ',', required = true)]
    pub endpoints: Vec<String>,
    /// Key prefix in etcd (several overlays can share one etcd).
    #[arg(long, default_value = "/vnet")]
    pub prefix: String,
    /// CA certificate for etcd over TLS.
    #[arg(long)]
    pub cacert: Option<PathBuf>,
    /// Client certificate and key for etcd over TLS.
    #[arg(long, requires = "key")]
    pub cert: Option<PathBuf>,
    #[arg(long, requires = "cert")]
    pub key: Option<PathBuf>,
    /// The etcd user to authenticate as (etcd's RBAC: a host's agent as
    /// its host's user, `vnet-agent auth add-host`).
    #[arg(long, requires = "password_file")]
    pub user: Option<String>,
    /// A file holding the user's password (its first line).
    #[arg(long, requires = "user")]
    pub password_file: Option<PathBuf>,
}

impl EtcdArgs {
    /// A client of the first endpoint, from the `start`-th on, that answers
    /// (a status request): one member at a time, so that a dead member is
    /// left for the next at once instead of being tried again by a
    /// balancing channel (a leader killed: issue 44's failover test); and
    /// the index of the one connected to, and the revision it is at.
    pub async fn connect_from(&self, start: usize) -> Result<(etcd_client::Client, usize, i64)> {
        let n = self.endpoints.len().max(1);
        let mut last = None;
        for k in 0..n {
            let i = (start + k) % n;
            let one = EtcdArgs { endpoints: vec![self.endpoints[i].clone()], ..self.clone() };
            let tried = async {
                let mut c = one.connect().await?;
                let st = tokio::time::timeout(REQUEST_TIMEOUT, c.status()).await.map_err(|_| anyhow::anyhow!("no answer"))??;
                let rev = st.header().map_or(0, |h| h.revision());
                anyhow::Ok((c, rev))
            };
            match tried.await {
                Ok((c, rev)) => return Ok((c, i, rev)),
                Err(e) => {
                    tracing::debug!("etcd {}: {e:#}", self.endpoints[i]);
                    last = Some(e.context(self.endpoints[i].clone()));
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no etcd endpoint given")))
    }

    pub async fn connect(&self) -> Result<etcd_client::Client> {
        use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};
        let mut o = ConnectOptions::new().with_timeout(REQUEST_TIMEOUT).with_connect_timeout(OP_TIMEOUT);
        if self.cacert.is_some() || self.cert.is_some() {
            let mut tls = TlsOptions::new();
            if let Some(ca) = &self.cacert {
                tls = tls.ca_certificate(Certificate::from_pem(std::fs::read(ca).with_context(|| format!("{}", ca.display()))?));
            }
            if let (Some(c), Some(k)) = (&self.cert, &self.key) {
                let cert = std::fs::read(c).with_context(|| format!("{}", c.display()))?;
                let key = std::fs::read(k).with_context(|| format!("{}", k.display()))?;
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            o = o.with_tls(tls);
        }
        if let (Some(u), Some(f)) = (&self.user, &self.password_file) {
            let pw = std::fs::read_to_string(f).with_context(|| format!("{}", f.display()))?;
            o = o.with_user(u, pw.lines().next().unwrap_or("")).with_auto_token_refresh(true);
        }
        Ok(etcd_client::Client::connect(&self.endpoints, Some(o)).await?)
    }
}
