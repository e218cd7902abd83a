//! Compiles the eBPF programs (`bpf/*.bpf.c`) with clang into objects that
//! the crate embeds. libbpf's headers come from the vendored libbpf-sys.
use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let libbpf_include = env::var("DEP_BPF_INCLUDE").expect("libbpf-sys exports its headers");
    let clang = env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let arch_include = format!("/usr/include/{}-linux-gnu", env::var("CARGO_CFG_TARGET_ARCH").unwrap());
    for name in ["fastpath", "vtoe_guard"] {
        let src = format!("bpf/{name}.bpf.c");
        println!("cargo:rerun-if-changed={src}");
        let out = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join(format!("{name}.bpf.o"));
        let status = Command::new(&clang)
            .args(["-O2", "-g", "-Wall", "-Werror", "-target", "bpf", "-D__TARGET_ARCH_x86"])
            .arg(format!("-I{libbpf_include}"))
            .arg(format!("-I{arch_include}"))
            .args(["-c", &src, "-o"])
            .arg(&out)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {clang} to build the eBPF programs ({e}); scripts/setup installs it"));
        assert!(status.success(), "clang failed to build {src}");
    }
}
