// Draws the ledger view embedded in the page (accounting/ledger/view.py says its shape).
// Built with textContent only: no value from the ledger is ever read as HTML.
"use strict";

const view = JSON.parse(document.getElementById("ledger-view").textContent);

// The figures of a status, in the order shown, with their labels.
const FIGURES = [
  ["privacy_unit", "privacy unit (each ε is per one)"],
  ["budget_epsilon", "budget ε"],
  ["delta", "δ"],
  ["spent_epsilon_filter", "spent ε (filter)"],
  ["reserved_epsilon", "reserved ε"],
  ["remaining_epsilon", "remaining ε"],
  ["spent_epsilon", "spent ε (non-adaptive PLD, a report)"],
  ["released_jobs", "released jobs"],
];

function element(tag, text, attributes) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = text;
  for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, value);
  return node;
}

// Six significant digits for reading; the exact value stays in data-value and the tooltip.
function shown(value) {
  if (typeof value !== "number") return value === null ? "" : String(value);
  return Number.isInteger(value) ? String(value) : String(parseFloat(value.toPrecision(6)));
}

function cell(value) {
  const td = element("td", shown(value));
  if (typeof value === "number") {
    td.className = "number";
    td.setAttribute("data-value", String(value));
    td.title = String(value);
  }
  return td;
}

function drawTable(section) {
  const wrapper = element("div", null, { class: "table", "data-table": section.title });
  wrapper.appendChild(element("h3", section.title));
  if (section.rows.length === 0) {
    wrapper.appendChild(element("p", "none", { class: "empty" }));
    return wrapper;
  }
  const table = element("table");
  const head = table.createTHead().insertRow();
  for (const column of section.columns) head.appendChild(element("th", column));
  const body = table.createTBody();
  for (const row of section.rows) {
    const tr = body.insertRow();
    for (const value of row) tr.appendChild(cell(value));
  }
  wrapper.appendChild(table);
  return wrapper;
}

function drawFigures(status) {
  const table = element("table", null, { class: "figures" });
  const body = table.createTBody();
  for (const [key, label] of FIGURES) {
    const tr = body.insertRow();
    tr.appendChild(element("th", label));
    const td = cell(status[key]);
    td.setAttribute("data-figure", key);
    tr.appendChild(td);
  }
  return table;
}

function drawBurnDown(container, points) {
  if (points === null) {
    container.appendChild(element("p", "history too long to replay here; see dpfleet ledger history", { class: "empty" }));
    return;
  }
  const chart = element("div", null, { class: "chart" });
  container.appendChild(chart);
  // The figures hold from the last change until now.
  const until = [...points, { ...points[points.length - 1], at: view.generated_at }];
  const at = until.map((point) => point.at);
  const spent = until.map((point) => point.spent_epsilon_filter);
  const held = until.map((point) => point.spent_epsilon_filter + point.reserved_epsilon);
  const budget = until.map((point) => point.budget_epsilon);
  const step = { shape: "hv" };
  Plotly.newPlot(
    chart,
    [
      { x: at, y: spent, name: "spent ε (filter)", mode: "lines", fill: "tozeroy", line: step },
      { x: at, y: held, name: "spent + reserved ε", mode: "lines", fill: "tonexty", line: step },
      { x: at, y: budget, name: "budget ε", mode: "lines", line: { shape: "hv", dash: "dash", color: "#444" } },
    ],
    {
      title: { text: "budget burn-down" },
      height: 360,
      margin: { t: 70, r: 10, b: 60, l: 50 },
      xaxis: { title: { text: "time (UTC)" } },
      yaxis: { title: { text: "ε" }, rangemode: "tozero" },
      legend: { orientation: "h", x: 0, y: 1.15 },
    },
    { displaylogo: false, responsive: true },
  );
}

function draw() {
  const main = document.getElementById("ledger");
  const viewer = view.viewer.admin ? "admin" : `tenant ${view.viewer.tenant}`;
  document.getElementById("viewer").textContent = `signed in as ${viewer}; figures of ${view.generated_at}`;
  if (view.datasets.length === 0) main.appendChild(element("p", "no datasets", { class: "empty" }));
  for (const tenant of view.tenants) {
    const section = element("section", null, { class: "tenant", "data-tenant": tenant.tenant });
    section.appendChild(element("h2", `tenant ${tenant.tenant}`));
    for (const table of tenant.tables) section.appendChild(drawTable(table));
    main.appendChild(section);
  }
  for (const dataset of view.datasets) {
    const section = element("section", null, { class: "dataset", "data-dataset": dataset.name });
    section.appendChild(element("h2", `dataset ${dataset.name}`));
    section.appendChild(drawFigures(dataset.status));
    drawBurnDown(section, dataset.burn_down);
    for (const table of dataset.tables) section.appendChild(drawTable(table));
    main.appendChild(section);
  }
}

draw();
