//! Any text sent to the control port: parsing never panics, and every rule
//! it accepts prints back to text that parses to the same rule.
#![no_main]
use libfuzzer_sys::fuzz_target;
use vnet_core::command::{parse_request, Command, RouteRef};
use vnet_core::RuleSpec;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(cmds) = parse_request(text) else { return };
    for (_, cmd) in cmds {
        let rule = match cmd {
            Command::RouteAdd(r, _) | Command::RouteDel(RouteRef::Rule(r)) => r,
            _ => continue,
        };
        let printed = rule.to_string();
        let again = RuleSpec::parse(&printed.split_whitespace().collect::<Vec<_>>());
        assert_eq!(again.as_ref(), Ok(&rule), "{printed}");
    }
});
