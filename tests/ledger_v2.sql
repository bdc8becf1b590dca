-- A ledger file as schema version 2 wrote it (before datasets had an admission rule, leases and hashed
-- history), by dpfleet's embedded ledger: budget ε 2 at δ 1e-05, a finished job, a stopped one and a running
-- one whose plan fitted the RDP ε over the whole order grid but does not fit the dataset's filter.
BEGIN TRANSACTION;
CREATE TABLE commits (
        reservation_id TEXT NOT NULL REFERENCES reservations(id),
        sequence INTEGER NOT NULL,
        steps INTEGER NOT NULL,
        committed_steps INTEGER NOT NULL,
        at TEXT NOT NULL,
        PRIMARY KEY (reservation_id, sequence)
    );
INSERT INTO "commits" VALUES('r-2aa157c1769162e9',0,600,600,'2026-11-23T19:32:42.741+00:00');
INSERT INTO "commits" VALUES('r-2aa157c1769162e9',1,400,1000,'2026-11-23T19:32:42.757+00:00');
INSERT INTO "commits" VALUES('r-5aaf6431af484f90',0,300,300,'2026-11-23T19:32:42.777+00:00');
INSERT INTO "commits" VALUES('r-214a57dfa74dd570',0,500,500,'2026-11-23T19:32:43.048+00:00');
CREATE TABLE datasets (
        id INTEGER PRIMARY KEY,
        tenant TEXT NOT NULL REFERENCES tenants(name),
        name TEXT NOT NULL,
        budget_epsilon REAL NOT NULL,
        delta REAL NOT NULL,
        held_rdp TEXT NOT NULL,
        committed_events TEXT NOT NULL,
        created_at TEXT NOT NULL,
        released_jobs INTEGER NOT NULL DEFAULT 0,
        UNIQUE (tenant, name)
    );
INSERT INTO "datasets" VALUES(1,'local','mnist',2.0,1.0e-05,'{"units": [70011958468737100, 70671039067358100, 71329448680447600, 72644450936361700, 73957069886518600, 75921580428095000, 82432268074400400, 88886092908545600, 95284376796715900, 101628343637161100, 107919139383135600, 114157845440012000, 120345487582347400, 126483042569110600, 132571447115894000, 139592543844499700, 146643557140192800, 153723893995249000, 160833009409113800, 167970403305916400, 175135621145667300, 182328253254317200, 189547936001330200, 196794352884895100, 204067236908563500, 211458957172526900, 218897763138887700, 226384495422671600, 233920038221735900, 241505327997327400, 249141364209775000, 256829221909985900, 264570065898583600, 272365167990541300, 280215927294800300, 288147778060981700, 296146097108635700, 304213723846184200, 312353786549950600, 320569755266401700, 328865507434876500, 337245409259195200, 345714417376713400, 354278206611563600, 362943331585698300, 371727301815658900, 380633023924113200, 389671849107346000, 398857325475533600, 408205786273343900, 417737128060925700, 427475849138713000, 437452447146468000, 447705316456105100, 458283347288078100, 469254731489804800, 480698626835382100, 492723779865025400, 505475187438091000, 519148487715247300, 534010802504507600, 550431214949959000, 568925770851543600, 590224573710230300, 615372797739057000, 645887424307933600, 683984957606143300, 732953488031522700, 797721893952492400, 885761014064808100, 1008517108159712100, 1183708195387110800, 1439022363877227600, 1818088968151456500, 2390098966341462300, 3265153028382267300, 4618167878815902400, 6724390055792891200, 10007247572636980400, 15090245635530456600, 22822871269467036000, 34218486893649963600, 50236550583196236800, 71434934929991820000, 97695891466393143200, 128260323159503451200, 162048877385515819200, 198013951132611878800, 235332699331694109400, 273438928595914525200, 311974769074101810800, 350726242194682785200, 389570139884939377200, 428437441532884039000, 467290339550445093400, 506108569609577316400, 544881555458547213000, 583604004119616554000, 622273480914020831000, 660889093323857516600, 699450784157078682000, 737958954276068643800, 776414261244933436200, 814817510914157316600, 853169597794821313000, 1234095131689990991800, 1611111591797217439600, 2004603131597597690400, 2949771606535032076800, 4225215184366697216000, 5496635287093065472000, 6761816181855052953600, 8021498051444786995200, 9276419005086370816000, 10527235822381237145600, 11774509468533010022400, 13018711902058702540800, 14260238765850710630400, 15499422319823930368000, 16736542796162927411200, 17971837816633860096000, 19205510022027615846400, 20437733202718019379200, 21668657221407621120000, 22898411978272533299200, 24127110620632592384000, 25354852156121742540800, 26581723593092120166400, 27807801704343169843200, 29033154488958919884800, 30257842390709959884800, 31481919318966936780800, 32705433508457077964800, 33928428246768018227200, 35150942492733903257600, 36373011404329311846400, 37594666791151327232000, 38815937503765133721600, 40036849769957528780800, 41257427486156524339200, 42477692470839923507200, 43697664685593797836800, 44917362428538758758400, 46136802504071254425600, 47356000372236041011200, 48574970280525327974400, 49793725380470395289600, 51012277831034134937600, 52230638890515482624000, 53448818998428055142400, 54666827848605870080000, 55884674454613933670400, 57102367208392051916800, 58319913932934951731200, 59537321929704426700800, 60754598021377825177600, 61971748590459825356800, 63188779614216656486400, 72921330317876447641600, 82648722221952864256000, 92372378443572380467200, 102093242734092521472000, 111811965640565578137600, 121529010164947638681600, 131244714804467194265600, 140959332765712406937600, 296328888791794683084800, 606983400707401377382400, 1228250413913617989632000, 1849508121834819498803200, 2470763506844128798310400, 4955779243856053456076800, 9925805497920129178009600], "unbounded_steps": [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]}','{"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 1800}], "schema": "dpfleet.events", "version": 1}','2026-11-23T19:32:42.625+00:00',2);
CREATE TABLE history (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at TEXT NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        tenant TEXT,
        dataset_id INTEGER REFERENCES datasets(id),
        details TEXT NOT NULL
    );
INSERT INTO "history" VALUES(1,'2026-11-23T19:32:42.624+00:00','root (embedded)','create_tenant','local',NULL,'{"tenant": "local", "token": false}');
INSERT INTO "history" VALUES(2,'2026-11-23T19:32:42.625+00:00','root (embedded)','create_dataset','local',1,'{"delta": 1e-05, "epsilon": 2.0}');
INSERT INTO "history" VALUES(3,'2026-11-23T19:32:42.731+00:00','root (embedded)','reserve','local',1,'{"held_epsilon_rdp": 0.8687835040507873, "job_id": "finished", "planned_events": {"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 1000}], "schema": "dpfleet.events", "version": 1}, "reservation_id": "r-2aa157c1769162e9"}');
INSERT INTO "history" VALUES(4,'2026-11-23T19:32:42.741+00:00','root (embedded)','commit','local',1,'{"events": {"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 600}], "schema": "dpfleet.events", "version": 1}, "job_id": "finished", "reservation_id": "r-2aa157c1769162e9", "sequence": 0}');
INSERT INTO "history" VALUES(5,'2026-11-23T19:32:42.757+00:00','root (embedded)','commit','local',1,'{"events": {"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 400}], "schema": "dpfleet.events", "version": 1}, "job_id": "finished", "reservation_id": "r-2aa157c1769162e9", "sequence": 1}');
INSERT INTO "history" VALUES(6,'2026-11-23T19:32:42.768+00:00','root (embedded)','release','local',1,'{"committed_steps": 1000, "freed_steps": 0, "job_id": "finished", "reservation_id": "r-2aa157c1769162e9"}');
INSERT INTO "history" VALUES(7,'2026-11-23T19:32:42.772+00:00','root (embedded)','reserve','local',1,'{"held_epsilon_rdp": 1.0038494018928201, "job_id": "stopped", "planned_events": {"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 1000}], "schema": "dpfleet.events", "version": 1}, "reservation_id": "r-5aaf6431af484f90"}');
INSERT INTO "history" VALUES(8,'2026-11-23T19:32:42.777+00:00','root (embedded)','commit','local',1,'{"events": {"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 300}], "schema": "dpfleet.events", "version": 1}, "job_id": "stopped", "reservation_id": "r-5aaf6431af484f90", "sequence": 0}');
INSERT INTO "history" VALUES(9,'2026-11-23T19:32:42.787+00:00','root (embedded)','release','local',1,'{"committed_steps": 300, "freed_steps": 700, "job_id": "stopped", "reservation_id": "r-5aaf6431af484f90"}');
INSERT INTO "history" VALUES(10,'2026-11-23T19:32:43.035+00:00','root (embedded)','reserve','local',1,'{"held_epsilon_rdp": 1.9741026921829625, "job_id": "running", "planned_events": {"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 500}, {"kind": "sampled_gaussian", "noise_multiplier": 0.9, "sampling_rate": 0.008, "sensitivity_factor": 1.0, "steps": 500}], "schema": "dpfleet.events", "version": 1}, "reservation_id": "r-214a57dfa74dd570"}');
INSERT INTO "history" VALUES(11,'2026-11-23T19:32:43.048+00:00','root (embedded)','commit','local',1,'{"events": {"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 500}], "schema": "dpfleet.events", "version": 1}, "job_id": "running", "reservation_id": "r-214a57dfa74dd570", "sequence": 0}');
CREATE TABLE reservations (
        id TEXT PRIMARY KEY,
        dataset_id INTEGER NOT NULL REFERENCES datasets(id),
        job_id TEXT NOT NULL,
        planned_events TEXT NOT NULL,
        committed_steps INTEGER NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('active', 'released')),
        created_at TEXT NOT NULL,
        released_at TEXT
    );
INSERT INTO "reservations" VALUES('r-2aa157c1769162e9',1,'finished','{"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 1000}], "schema": "dpfleet.events", "version": 1}',1000,'released','2026-11-23T19:32:42.731+00:00','2026-11-23T19:32:42.767+00:00');
INSERT INTO "reservations" VALUES('r-5aaf6431af484f90',1,'stopped','{"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 1000}], "schema": "dpfleet.events", "version": 1}',300,'released','2026-11-23T19:32:42.772+00:00','2026-11-23T19:32:42.787+00:00');
INSERT INTO "reservations" VALUES('r-214a57dfa74dd570',1,'running','{"events": [{"kind": "sampled_gaussian", "noise_multiplier": 1.1, "sampling_rate": 0.004, "sensitivity_factor": 1.0, "steps": 500}, {"kind": "sampled_gaussian", "noise_multiplier": 0.9, "sampling_rate": 0.008, "sensitivity_factor": 1.0, "steps": 500}], "schema": "dpfleet.events", "version": 1}',500,'active','2026-11-23T19:32:43.034+00:00',NULL);
CREATE TABLE schema_version (version INTEGER NOT NULL);
INSERT INTO "schema_version" VALUES(2);
CREATE TABLE tenants (
        name TEXT PRIMARY KEY,
        key_id TEXT UNIQUE,
        token_salt BLOB,
        token_hash BLOB,
        created_at TEXT NOT NULL
    );
INSERT INTO "tenants" VALUES('local',NULL,NULL,NULL,'2026-11-23T19:32:42.624+00:00');
CREATE UNIQUE INDEX one_active_reservation_per_job ON reservations (dataset_id, job_id) WHERE state = 'active';
CREATE INDEX reservations_by_dataset ON reservations (dataset_id, state);
CREATE INDEX history_by_tenant ON history (tenant, id);
CREATE INDEX history_by_dataset ON history (dataset_id, id);
CREATE TRIGGER history_is_append_only_update BEFORE UPDATE ON history
        BEGIN SELECT RAISE(ABORT, 'the ledger history is append-only'); END;
CREATE TRIGGER history_is_append_only_delete BEFORE DELETE ON history
        BEGIN SELECT RAISE(ABORT, 'the ledger history is append-only'); END;
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('history',11);
COMMIT;
