-- Finance views over the ledger, defined as temporary views on every connection by
-- pipeline.storage.warehouse (the warehouse holds data only). They show only published hours: hours
-- reconciled with no failed blocking check. `held_back_hours` lists every other invoiced hour
-- and why.

-- Each warehouse table a query names is one more catalog lookup (DuckLake), so the views read
-- each table once.
CREATE OR REPLACE TEMP VIEW published_hours AS
SELECT i.hour, i.pool
FROM invoices i
JOIN (SELECT hour, pool FROM reconciliation
      GROUP BY hour, pool
      HAVING NOT bool_or(blocking AND NOT passed)) r
  ON r.hour = i.hour AND r.pool = i.pool;

CREATE OR REPLACE TEMP VIEW held_back_hours AS
SELECT i.hour, i.pool, i.amount_nano,
       CASE WHEN count(r.check_name) = 0 THEN 'not reconciled yet'
            ELSE 'failed blocking checks: ' || string_agg(DISTINCT r.check_name, ', ' ORDER BY r.check_name)
       END AS reason
FROM invoices i
LEFT JOIN reconciliation r
       ON r.hour = i.hour AND r.pool = i.pool
LEFT JOIN published_hours p ON p.hour = i.hour AND p.pool = i.pool
WHERE p.hour IS NULL
  AND (r.check_name IS NULL OR (r.blocking AND NOT r.passed))
GROUP BY i.hour, i.pool, i.amount_nano;

-- The one definition of a line's request count that every view, `stepledger costs` and the
-- report share: a request is counted once, on the lines that charge it. The cache credit line
-- names the requests that read the cache, which their usage lines count already.
CREATE OR REPLACE TEMP VIEW counted_ledger_lines AS
SELECT *, CASE WHEN line_kind = 'cache_credit' THEN 0 ELSE requests END AS charged_requests
FROM ledger_lines;

CREATE OR REPLACE TEMP VIEW published_ledger_lines AS
SELECT l.*
FROM counted_ledger_lines l
JOIN published_hours p ON p.hour = l.hour AND p.pool = l.pool;

-- Exact dollars from nano-dollars (DECIMAL(38, 9)), and the unit costs derived from totals.
CREATE OR REPLACE TEMP MACRO nano_to_usd(nano) AS CAST(nano AS DECIMAL(38, 0)) * 0.000000001;
CREATE OR REPLACE TEMP MACRO usd_per(nano, units) AS nano_to_usd(nano) / nullif(units, 0);

-- Totals per tenant (and feature), computed once for every breakdown the views offer.
-- `tokens` are the tokens the GPUs computed (new_tokens); prefix-cache hits are reported
-- apart as cached_tokens. Unit costs divide the totals; requests are `charged_requests`.
CREATE OR REPLACE TEMP VIEW cost_rollup AS
SELECT hour, pool, day, tenant, feature,
       GROUPING(hour, pool, day, tenant, feature) AS breakdown,
       CAST(sum(amount_nano) AS BIGINT) AS amount_nano,
       nano_to_usd(sum(amount_nano)) AS amount_usd,
       CAST(coalesce(sum(charged_requests), 0) AS BIGINT) AS requests,
       CAST(sum(new_tokens) AS BIGINT) AS tokens,
       CAST(sum(cached_tokens) AS BIGINT) AS cached_tokens,
       usd_per(sum(amount_nano), sum(charged_requests)) AS usd_per_request,
       usd_per(sum(amount_nano) * 1000, sum(new_tokens)) AS usd_per_1k_tokens
FROM (SELECT *, CAST(date_trunc('day', hour) AS DATE) AS day FROM published_ledger_lines)
GROUP BY GROUPING SETS ((hour, pool, tenant), (day, tenant), (day, tenant, feature), (tenant), (tenant, feature));

-- GROUPING() sets one bit per column left out, hour being the highest of the five.
CREATE OR REPLACE TEMP VIEW tenant_costs_hourly AS
SELECT * EXCLUDE (day, feature, breakdown)
FROM cost_rollup WHERE breakdown = 5;   -- 0b00101: day and feature left out

-- Finance's most frequent query, aggregated on its own: grouping sets scan the lines once
-- per set.
CREATE OR REPLACE TEMP VIEW tenant_costs_daily AS
SELECT day, tenant,
       CAST(sum(amount_nano) AS BIGINT) AS amount_nano,
       nano_to_usd(sum(amount_nano)) AS amount_usd,
       CAST(sum(charged_requests) AS BIGINT) AS requests,
       CAST(sum(new_tokens) AS BIGINT) AS tokens,
       CAST(sum(cached_tokens) AS BIGINT) AS cached_tokens,
       usd_per(sum(amount_nano), sum(charged_requests)) AS usd_per_request,
       usd_per(sum(amount_nano) * 1000, sum(new_tokens)) AS usd_per_1k_tokens
FROM (SELECT *, CAST(date_trunc('day', hour) AS DATE) AS day FROM published_ledger_lines)
GROUP BY day, tenant;

CREATE OR REPLACE TEMP VIEW feature_costs_daily AS
SELECT * EXCLUDE (hour, pool, breakdown)
FROM cost_rollup WHERE breakdown = 24;  -- 0b11000

CREATE OR REPLACE TEMP VIEW tenant_costs AS
SELECT * EXCLUDE (hour, pool, day, feature, breakdown)
FROM cost_rollup WHERE breakdown = 29;  -- 0b11101: over all published hours

CREATE OR REPLACE TEMP VIEW feature_costs AS
SELECT * EXCLUDE (hour, pool, day, breakdown)
FROM cost_rollup WHERE breakdown = 28;  -- 0b11100

-- What each request of a published hour cost, and who pays it. `tenant` and `feature` are
-- the request's own (null without gateway context); `paid_by` is 'platform' for a retry the
-- platform caused and pays (policy platform_pays_platform_retries), else 'tenant';
-- `billed_tenant` and `billed_feature` name the ledger line its charge is on (the capacity
-- owner's '(platform-retry)' line, '(unattributed)' without context), so per hour, pool and
-- billed tenant the requests sum to that tenant's usage, unattributed and platform_retry
-- lines. Null in hours billed before request_costs kept the line kind.
CREATE OR REPLACE TEMP VIEW cost_per_request AS
SELECT c.hour, c.pool, c.request_id, c.tenant, c.feature, c.api_key_id,
       CASE c.line_kind WHEN 'platform_retry' THEN 'platform'
                        WHEN 'usage' THEN 'tenant'
                        WHEN 'unattributed' THEN 'tenant' END AS paid_by,
       c.line_kind,
       CASE c.line_kind WHEN 'platform_retry' THEN r.tenant
                        WHEN 'unattributed' THEN '(unattributed)'
                        WHEN 'usage' THEN c.tenant END AS billed_tenant,
       CASE c.line_kind WHEN 'platform_retry' THEN r.feature
                        WHEN 'unattributed' THEN '(unattributed)'
                        WHEN 'usage' THEN coalesce(c.feature, '(unattributed)') END AS billed_feature,
       c.amount_nano, nano_to_usd(c.amount_nano) AS amount_usd,
       c.compute_nano, c.kv_nano, c.steps,
       c.prompt_tokens, c.output_tokens, c.new_tokens, c.cached_tokens,
       usd_per(c.amount_nano * 1000, c.new_tokens) AS usd_per_1k_tokens
FROM request_costs c
JOIN published_hours p ON p.hour = c.hour AND p.pool = c.pool
LEFT JOIN (SELECT hour, pool, tenant, feature FROM ledger_lines WHERE line_kind = 'platform_retry') r
       ON r.hour = c.hour AND r.pool = c.pool;

-- The price list FOCUS publishes as SKUs: one SKU per pool, GPU time on it, priced per
-- GPU-hour at the pool's usd_per_gpu_hour (a new price is a new SkuPriceId of the same SKU).
-- The price is turned into integer nano-dollars once, here, so a line's GPU-hours come from
-- integers: the invoice column is a DOUBLE of a price with at most 9 decimals.
CREATE OR REPLACE TEMP VIEW gpu_hour_prices AS
SELECT hour, pool,
       CAST(round(usd_per_gpu_hour * 1000000000) AS BIGINT) AS price_nano,
       pool || '/gpu-hour'                                  AS sku_id
FROM invoices;

-- GPU-hours that `nano` buys at `price_nano` per GPU-hour, to 18 decimal places (truncated):
-- FinOps tools check ListUnitPrice x PricingQuantity = ListCost to 1e-9, which a quantity
-- of 9 places misses by up to half a nano-dollar times the price.
CREATE OR REPLACE TEMP MACRO gpu_hours(nano, price_nano) AS
    CAST(CAST(nano AS HUGEINT) * 1000000000000000000 // price_nano AS DECIMAL(38, 0))
    * CAST(0.000000000000000001 AS DECIMAL(38, 18));

-- The ledger as a FOCUS 1.2 cost and usage dataset: all mandatory columns, the conditional
-- ones that apply to an internal chargeback (sub account = feature, resource = pool, consumed
-- quantity = tokens, unit pricing = the pool's price per GPU-hour as a SKU), and stepledger's
-- own columns with the x_ prefix. Nothing is discounted, so BilledCost = EffectiveCost =
-- ListCost = ContractedCost, and a line's PricingQuantity is the GPU time its cost buys at
-- the list price. The cache credit is a Credit: no SKU, no quantity. Times carry their zone
-- (UTC); quantities are decimals. Every line is on an invoice: the number `stepledger close`
-- gave it, or, while its month is open, the provisional invoice of its tenant and month
-- (SL-YYYYMM-provisional-TENANT). A closed month's hour billed again is an Adjustment of
-- ChargeClass Correction per tenant (invoice_adjustments), for the hour it corrects, billed on
-- the invoice that carries it. CommitmentDiscountStatus is there, always null, because
-- FinOps validators test ConsumedQuantity's nullability against it. `stepledger export
-- focus` writes the view to a file.
CREATE OR REPLACE TEMP VIEW focus_costs AS
SELECT
    nano_to_usd(amount_nano)                                            AS BilledCost,
    tenant                                                              AS BillingAccountId,
    tenant                                                              AS BillingAccountName,
    'Tenant'                                                            AS BillingAccountType,
    'USD'                                                               AS BillingCurrency,
    timezone('UTC', billing_month + INTERVAL 1 MONTH)                   AS BillingPeriodEnd,
    timezone('UTC', CAST(billing_month AS TIMESTAMP))                   AS BillingPeriodStart,
    CASE WHEN line_kind = 'adjustment' THEN 'Adjustment'
         WHEN priced THEN 'Usage' ELSE 'Credit' END                     AS ChargeCategory,
    CASE WHEN line_kind = 'adjustment' THEN 'Correction' END            AS ChargeClass,
    CASE line_kind
        WHEN 'usage'          THEN 'GPU inference on pool ' || pool || ', measured engine steps'
        -- The capacity_owner policy books idle on the owner's '(idle)' feature; spread idle
        -- lands on the tenants' own features.
        WHEN 'idle'           THEN 'Idle GPU time on pool ' || pool ||
                                   CASE WHEN feature = '(idle)' THEN ', charged to its capacity owner'
                                        ELSE ', spread by usage' END
        WHEN 'headroom'       THEN 'Headroom GPU time on pool ' || pool || ' beyond target utilization'
        WHEN 'unattributed'   THEN 'GPU inference on pool ' || pool || ' by requests without tenant context'
        WHEN 'platform_retry' THEN 'GPU inference on pool ' || pool || ' retried after a platform timeout'
        WHEN 'cache_credit'   THEN 'Prefix-cache read credit on pool ' || pool
        WHEN 'adjustment'     THEN 'Correction of ' || coalesce('invoice ' || corrects_invoice_id, 'a closed month')
                                   || ': the hour on pool ' || pool || ' was billed again (' || reason || ')'
    END                                                                 AS ChargeDescription,
    CASE WHEN line_kind = 'adjustment' THEN 'One-Time' ELSE 'Usage-Based' END
                                                                        AS ChargeFrequency,
    timezone('UTC', hour + INTERVAL 1 HOUR)                             AS ChargePeriodEnd,
    timezone('UTC', hour)                                               AS ChargePeriodStart,
    CAST(NULL AS VARCHAR)                                               AS CommitmentDiscountStatus,
    CASE WHEN priced THEN CAST(new_tokens AS DECIMAL(38, 9)) END        AS ConsumedQuantity,
    CASE WHEN priced THEN 'Tokens' END                                  AS ConsumedUnit,
    nano_to_usd(amount_nano)                                            AS ContractedCost,
    CASE WHEN priced THEN nano_to_usd(price_nano) END                   AS ContractedUnitPrice,
    nano_to_usd(amount_nano)                                            AS EffectiveCost,
    'stepledger'                                                        AS InvoiceIssuerName,
    coalesce(invoice_id, strftime(billing_month, 'SL-%Y%m-provisional-') || tenant)
                                                                        AS InvoiceId,
    nano_to_usd(amount_nano)                                            AS ListCost,
    CASE WHEN priced THEN nano_to_usd(price_nano) END                   AS ListUnitPrice,
    CASE WHEN priced THEN 'Standard' END                                AS PricingCategory,
    CASE WHEN priced THEN gpu_hours(amount_nano, price_nano) END        AS PricingQuantity,
    CASE WHEN priced THEN 'GPU-Hours' END                               AS PricingUnit,
    'USD'                                                               AS PricingCurrency,
    CASE WHEN priced THEN nano_to_usd(price_nano) END                   AS PricingCurrencyContractedUnitPrice,
    nano_to_usd(amount_nano)                                            AS PricingCurrencyEffectiveCost,
    CASE WHEN priced THEN nano_to_usd(price_nano) END                   AS PricingCurrencyListUnitPrice,
    'stepledger'                                                        AS ProviderName,
    'stepledger'                                                        AS PublisherName,
    pool                                                                AS ResourceId,
    pool                                                                AS ResourceName,
    'GPU inference pool'                                                AS ResourceType,
    'AI and Machine Learning'                                           AS ServiceCategory,
    'Generative AI'                                                     AS ServiceSubcategory,
    'LLM inference'                                                     AS ServiceName,
    CASE WHEN priced THEN sku_id END                                    AS SkuId,
    CASE WHEN priced THEN 'GPU Hours' END                               AS SkuMeter,
    CAST(NULL AS VARCHAR)                                               AS SkuPriceDetails,
    CASE WHEN priced THEN sku_id || '@' || rtrim(rtrim(CAST(nano_to_usd(price_nano) AS VARCHAR), '0'), '.') END
                                                                        AS SkuPriceId,
    tenant || '/' || feature                                            AS SubAccountId,
    feature                                                             AS SubAccountName,
    'Feature'                                                           AS SubAccountType,
    json_object('stepledger/line_kind', line_kind, 'stepledger/feature', feature,
                'stepledger/policy_version', policy_version,
                'stepledger/weights_version', weights_version)          AS Tags,
    line_kind                                                           AS x_LineKind,
    amount_nano                                                         AS x_AmountNano,
    requests                                                            AS x_Requests,
    cached_tokens                                                       AS x_CachedTokens,
    policy_version                                                      AS x_PolicyVersion,
    weights_version                                                     AS x_WeightsVersion
FROM (SELECT l.*, p.price_nano, p.sku_id, l.line_kind <> 'cache_credit' AS priced,
             CAST(date_trunc('month', l.hour) AS DATE) AS billing_month
      FROM published_ledger_lines l
      JOIN gpu_hour_prices p ON p.hour = l.hour AND p.pool = l.pool
      UNION ALL BY NAME
      SELECT hour, pool, tenant, '(adjustment)' AS feature, 'adjustment' AS line_kind,
             amount_nano, 0 AS requests, 0 AS new_tokens, 0 AS cached_tokens, FALSE AS priced,
             invoice_month AS billing_month, reason, corrects_invoice_id
      FROM invoice_adjustments)
LEFT JOIN (SELECT month AS invoice_month, tenant AS invoice_tenant, invoice_id FROM invoice_numbers)
       ON invoice_month = billing_month AND invoice_tenant = tenant;

-- Provisional figures (pipeline.live): usage priced from closed segments while the hour runs.
-- Idle and headroom are not in them (known when the hour closes); once an hour is published
-- its final ledger lines replace them in `spend_lines`.
CREATE OR REPLACE TEMP VIEW provisional_cost_per_request AS
SELECT hour, pool, request_id,
       arg_max(tenant, priced_at) AS tenant, arg_max(feature, priced_at) AS feature,
       arg_max(api_key_id, priced_at) AS api_key_id, arg_max(line_kind, priced_at) AS line_kind,
       CAST(sum(amount_nano) AS BIGINT) AS amount_nano, nano_to_usd(sum(amount_nano)) AS amount_usd,
       CAST(sum(compute_nano) AS BIGINT) AS compute_nano, CAST(sum(kv_nano) AS BIGINT) AS kv_nano,
       CAST(sum(steps) AS BIGINT) AS steps, CAST(sum(new_tokens) AS BIGINT) AS new_tokens,
       CAST(sum(cached_tokens) AS BIGINT) AS cached_tokens,
       max(last_step_end_utc_ns) AS last_step_end_utc_ns, max(priced_at) AS priced_at
FROM provisional_request_costs
GROUP BY hour, pool, request_id;

-- Provisional usage lines of the hours not published yet, per tenant and feature.
CREATE OR REPLACE TEMP VIEW provisional_spend_lines AS
SELECT l.hour, l.pool, l.tenant, l.feature, l.line_kind,
       CAST(sum(l.amount_nano) AS BIGINT) AS amount_nano,
       CAST(sum(l.new_tokens) AS BIGINT) AS new_tokens,
       CAST(sum(l.cached_tokens) AS BIGINT) AS cached_tokens,
       max(l.priced_at) AS priced_at
FROM provisional_lines l
WHERE NOT EXISTS (SELECT 1 FROM published_hours p WHERE p.hour = l.hour AND p.pool = l.pool)
GROUP BY ALL;

-- Spend as a budget or a gateway sees it: the final lines of published hours, every kind,
-- and the provisional usage of the others (basis says which).
CREATE OR REPLACE TEMP VIEW spend_lines AS
SELECT hour, pool, tenant, feature, line_kind, amount_nano, new_tokens, cached_tokens,
       'final' AS basis
FROM published_ledger_lines
UNION ALL
SELECT hour, pool, tenant, feature, line_kind, amount_nano, new_tokens, cached_tokens,
       'provisional' AS basis
FROM provisional_spend_lines;

-- Per billed tenant-hour, the provisional usage beside the hourly ledger's usage lines (usage,
-- unattributed, platform_retry) once the hour is billed: what closing the hour changed.
CREATE OR REPLACE TEMP VIEW provisional_vs_final AS
WITH provisional AS (
    SELECT hour, pool, tenant, CAST(sum(amount_nano) AS BIGINT) AS provisional_nano
    FROM provisional_lines GROUP BY ALL),
final AS (
    SELECT hour, pool, tenant, CAST(sum(amount_nano) AS BIGINT) AS final_nano
    FROM ledger_lines
    WHERE line_kind IN ('usage', 'unattributed', 'platform_retry') GROUP BY ALL)
SELECT hour, pool, tenant, provisional_nano, final_nano,
       final_nano - provisional_nano AS delta_nano,
       abs(final_nano - provisional_nano)
           / nullif(greatest(abs(final_nano), abs(provisional_nano)), 0) AS delta_fraction,
       EXISTS (SELECT 1 FROM published_hours p WHERE p.hour = x.hour AND p.pool = x.pool)
           AS published
FROM (SELECT hour, pool, tenant, coalesce(provisional_nano, 0) AS provisional_nano,
             coalesce(final_nano, 0) AS final_nano
      FROM provisional FULL JOIN final USING (hour, pool, tenant)) x
WHERE EXISTS (SELECT 1 FROM invoices i WHERE i.hour = x.hour AND i.pool = x.pool);

-- Every hour known, final or provisional: published, held back (and why), or provisional
-- (priced live, not billed yet).
CREATE OR REPLACE TEMP VIEW hour_status AS
SELECT hour, pool, 'published' AS status, NULL AS reason FROM published_hours
UNION ALL
SELECT hour, pool, 'held_back', reason FROM held_back_hours
UNION ALL
SELECT DISTINCT l.hour, l.pool, 'provisional', 'priced live; not billed yet'
FROM provisional_lines l
WHERE NOT EXISTS (SELECT 1 FROM invoices i WHERE i.hour = l.hour AND i.pool = l.pool);

-- Each tenant's invoice of each month: issued (its month closed by `stepledger close`, the
-- invoice never changed since) or open (provisional, as the ledger stands). charges_nano is
-- what the month's published hours cost (for an issued invoice, as they stood when it was
-- issued), adjustments_nano the corrections of closed months carried on it
-- (invoice_adjustments), amount_nano their sum: what the tenant owes on it.
CREATE OR REPLACE TEMP VIEW tenant_invoices AS
WITH charges AS (
    SELECT CAST(date_trunc('month', hour) AS DATE) AS month, tenant, sum(amount_nano) AS nano
    FROM published_ledger_lines GROUP BY ALL),
carried AS (
    SELECT invoice_month AS month, tenant, sum(amount_nano) AS nano
    FROM invoice_adjustments GROUP BY ALL),
invoiced AS (
    SELECT month, tenant FROM charges UNION SELECT month, tenant FROM carried
    UNION SELECT month, tenant FROM invoice_numbers),
totals AS (
    SELECT i.month, i.tenant, n.invoice_id, m.month IS NOT NULL AS closed,
           coalesce(n.amount_nano, 0) AS issued, coalesce(c.nano, 0) AS charged,
           coalesce(a.nano, 0) AS adjusted
    FROM invoiced i
    LEFT JOIN charges c USING (month, tenant)
    LEFT JOIN carried a USING (month, tenant)
    LEFT JOIN invoice_numbers n USING (month, tenant)
    LEFT JOIN closed_months m USING (month))
SELECT month, tenant,
       coalesce(invoice_id, strftime(month, 'SL-%Y%m-provisional-') || tenant) AS invoice_id,
       CASE WHEN closed THEN 'issued' ELSE 'open' END AS status,
       CAST(CASE WHEN closed THEN issued - adjusted ELSE charged END AS BIGINT) AS charges_nano,
       CAST(adjusted AS BIGINT) AS adjustments_nano,
       CAST(CASE WHEN closed THEN issued ELSE charged + adjusted END AS BIGINT) AS amount_nano,
       nano_to_usd(CASE WHEN closed THEN issued ELSE charged + adjusted END) AS amount_usd
FROM totals;
