//! Renders an [`NftPlan`] as the one `nft -f` transaction Istio's knftables would
//! send, and the transactions that remove or replace Istio's tables. Text only.

use super::table::{NftPlan, NftTable};

/// The `nft -f` transaction that installs `plan` the way Istio's knftables does: per
/// table with rules, `add table`, `flush table`, `add chain` for each chain that has
/// rules, then the rules (an insert into an empty chain, or past its end, is an add).
pub fn render(plan: &NftPlan) -> String {
    let mut out = String::new();
    for table in plan.tables() {
        let name = table.name();
        out.push_str(&format!("add table inet {name}\nflush table inet {name}\n"));
        for (chain, hook) in table.chains() {
            if plan.rules_in(table).any(|r| r.chain == *chain) {
                match hook {
                    Some(spec) => out.push_str(&format!("add chain inet {name} {chain} {{ {spec} }}\n")),
                    None => out.push_str(&format!("add chain inet {name} {chain}\n")),
                }
            }
        }
        let mut count: std::collections::HashMap<&str, usize> = Default::default();
        for rule in plan.rules_in(table) {
            let n = count.entry(rule.chain).or_default();
            match rule.index {
                Some(i) if *n > 0 && i < *n => {
                    out.push_str(&format!(
                        "insert rule inet {name} {} index {i} {}\n",
                        rule.chain, rule.expr
                    ));
                }
                _ => out.push_str(&format!("add rule inet {name} {} {}\n", rule.chain, rule.expr)),
            }
            *n += 1;
        }
    }
    out
}

/// The transaction that removes every Istio table, whether present or not.
pub fn render_cleanup() -> String {
    NftTable::ALL.iter().map(|t| format!("add table inet {0}\ndelete table inet {0}\n", t.name())).collect()
}

/// A replacing transaction: delete every Istio table, then install `plan`. One kernel
/// transaction, so the namespace never sees a half-applied state.
pub fn render_replace(plan: &NftPlan) -> String {
    let mut out = render_cleanup();
    out.push_str(&render(plan));
    out
}
