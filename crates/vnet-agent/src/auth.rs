//! `vnet-agent auth`: provisions etcd's RBAC for the overlay, so that each
//! host's agent writes only its own records (docs/controller.md "Who may
//! write what"). Run by an administrator, as etcd's root user once auth is
//! on:
//!
//! - `enable`: makes the root user (password from a file) and turns etcd's
//!   authentication on; from then on every client needs a user;
//! - `add-host <host>`: the user and role `vnet-host-<host>`, which may read
//!   the overlay's whole prefix and write only `<p>/host/<host>/`;
//! - `add-reader <name>`: a user that may only read the prefix (for
//!   `vnet-agent show`, monitoring, the CNI plugin's MAC check).
//!
//! Each is safe to run again: what exists is kept, the password is set anew.

use crate::etcd::EtcdArgs;
use crate::records::host_prefix;
use anyhow::{Context, Result};
use etcd_client::{Client, Permission};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct AuthArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand, Debug)]
enum What {
    /// Make the root user and turn etcd's authentication on.
    Enable {
        /// A file holding root's password (its first line).
        #[arg(long)]
        root_password_file: PathBuf,
    },
    /// Make host HOST's user and role: read the prefix, write its own records.
    AddHost {
        host: String,
        /// A file holding the user's password (its first line).
        #[arg(long = "new-password-file")]
        password_file: PathBuf,
    },
    /// Make a user that may only read the prefix.
    AddReader {
        name: String,
        /// A file holding the user's password (its first line).
        #[arg(long = "new-password-file")]
        password_file: PathBuf,
    },
}

/// The etcd user (and role) of host `host`'s agent.
pub fn host_user(host: &str) -> String {
    format!("vnet-host-{host}")
}

fn password(f: &PathBuf) -> Result<String> {
    let pw = std::fs::read_to_string(f).with_context(|| format!("{}", f.display()))?;
    let pw = pw.lines().next().unwrap_or("").to_string();
    anyhow::ensure!(pw.len() >= 8, "{}: a password of at least 8 characters is wanted", f.display());
    Ok(pw)
}

/// Adds the user, or sets its password if it exists.
async fn user(c: &mut Client, name: &str, pw: &str) -> Result<()> {
    if c.user_get(name).await.is_ok() {
        c.user_change_password(name, pw).await.with_context(|| format!("password of etcd user {name}"))?;
    } else {
        c.user_add(name, pw, None).await.with_context(|| format!("etcd user {name}"))?;
    }
    Ok(())
}

/// Adds the role if it does not exist, grants it `perms`, and it to `user`.
async fn role(c: &mut Client, name: &str, perms: Vec<Permission>, user: &str) -> Result<()> {
    if c.role_get(name).await.is_err() {
        c.role_add(name).await.with_context(|| format!("etcd role {name}"))?;
    }
    for p in perms {
        c.role_grant_permission(name, p).await.with_context(|| format!("permission of etcd role {name}"))?;
    }
    c.user_grant_role(user, name).await.with_context(|| format!("etcd role {name} to user {user}"))?;
    Ok(())
}

pub async fn auth(args: AuthArgs) -> Result<()> {
    let mut c = args.etcd.connect().await?;
    let all = format!("{}/", args.etcd.prefix);
    match args.what {
        What::Enable { root_password_file } => {
            user(&mut c, "root", &password(&root_password_file)?).await?;
            c.user_grant_role("root", "root").await.context("etcd role root to user root")?;
            c.auth_enable().await.context("turning etcd's authentication on")?;
            println!("etcd authentication on; root made");
        }
        What::AddHost { host, password_file } => {
            crate::model::check_host_name(&host)?;
            let name = host_user(&host);
            user(&mut c, &name, &password(&password_file)?).await?;
            let own = host_prefix(&args.etcd.prefix, &host);
            role(&mut c, &name, vec![Permission::read(all.as_str()).with_prefix(), Permission::read_write(own.as_str()).with_prefix()], &name).await?;
            println!("etcd user {name}: reads {all}, writes {own}");
        }
        What::AddReader { name, password_file } => {
            user(&mut c, &name, &password(&password_file)?).await?;
            role(&mut c, "vnet-reader", vec![Permission::read(all.as_str()).with_prefix()], &name).await?;
            println!("etcd user {name}: reads {all}");
        }
    }
    Ok(())
}
